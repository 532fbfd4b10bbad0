// Files mpicoll writes where other users of the node can reach: the shared
// temporary directory and folders the user names.  Nothing another user
// prepared is trusted (docs/security.md states the threat model):
//
//   * The shared temporary directory holds one folder per user,
//     <tmp>/mpicoll-<uid>, and everything mpicoll puts there goes inside it
//     (each job's flight folder, the stacks report).  Made with mode 0700; one
//     that exists is used only if it is a real folder (not a link) of this user
//     that nobody else can write to (a readable one is closed to 0700), else it
//     is refused with the reason.  Every folder below it is held to the same
//     rule, so only this user can have made anything there.
//   * A folder the user names (MPICOLL_FLIGHT_DIR, MPICOLL_TRACE, start_trace)
//     is made 0700 where missing; one that exists, or a link at its name, must
//     be this user's or root's (/tmp is root's): another user's is refused.
//   * A file is written to a fresh temporary name in the opened folder
//     (O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600) and renamed over its name: no
//     link is followed, no file that exists is reused or written through, and
//     a reader never sees half a file.  Every step after the check goes through
//     the folder's descriptor, so a folder swapped after it was checked is not
//     the one written to.
//
// The Python side (runtime/own_files.py) applies the same rule where Python
// writes or checks early; tests/test_shared_node.py holds the two to one verdict.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <sys/stat.h>
#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <string>

namespace mpicoll {

enum class FolderKind {
  kPrivate,  // mpicoll chose its name, in a shared place: this user's, nobody else's to write
  kNamed,    // the user named it: this user's or root's
};

// A folder opened for writing, or why it cannot be (fd -1).
class OwnFolder {
 public:
  OwnFolder() = default;
  OwnFolder(const OwnFolder&) = delete;
  OwnFolder& operator=(const OwnFolder&) = delete;
  OwnFolder(OwnFolder&& other) noexcept : fd_(other.fd_), problem_(std::move(other.problem_)) {
    other.fd_ = -1;
  }
  OwnFolder& operator=(OwnFolder&& other) noexcept {
    if (this != &other) {
      Close();
      fd_ = other.fd_;
      problem_ = std::move(other.problem_);
      other.fd_ = -1;
    }
    return *this;
  }
  ~OwnFolder() { Close(); }

  static OwnFolder Refused(std::string why) {
    OwnFolder folder;
    folder.problem_ = std::move(why);
    return folder;
  }
  static OwnFolder Opened(int fd) {
    OwnFolder folder;
    folder.fd_ = fd;
    return folder;
  }

  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& problem() const { return problem_; }

 private:
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
  std::string problem_;
};

inline std::string ModeText(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof(text), "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

// Why the folder open at `fd` (named `path`) may not be written to, or "".
// A private folder readable by others is closed to 0700 here: only its owner
// (this user) can have written into it, so its contents are this user's.
inline std::string FolderProblem(int fd, const std::string& path, FolderKind kind) {
  struct stat info;
  if (fstat(fd, &info) != 0) return path + ": " + std::strerror(errno);
  if (!S_ISDIR(info.st_mode)) return path + " is not a folder";
  const uid_t me = geteuid();
  if (info.st_uid != me && !(kind == FolderKind::kNamed && info.st_uid == 0)) {
    return path + " belongs to uid " + std::to_string(info.st_uid) + ", not to this user (uid " +
           std::to_string(me) + ")";
  }
  if (kind == FolderKind::kPrivate) {
    if (info.st_mode & (S_IWGRP | S_IWOTH)) {
      return path + " is writable by other users (mode " + ModeText(info.st_mode) + ")";
    }
    if ((info.st_mode & 077) && fchmod(fd, 0700) != 0) {
      return path + " is open to other users (mode " + ModeText(info.st_mode) +
             ") and cannot be closed: " + std::strerror(errno);
    }
  }
  return std::string();
}

// Opens (making it if missing and `create`) the folder `name` inside the
// folder open at `parent` (AT_FDCWD: `name` is a path), held to `kind`'s rule.
inline OwnFolder OpenFolderAt(int parent, const std::string& name, const std::string& path,
                              FolderKind kind, bool create) {
  // A link at the name: a private folder never is one; a named one may be
  // (a user's /scratch link), if the link is this user's or root's.
  struct stat link;
  const bool exists = fstatat(parent, name.c_str(), &link, AT_SYMLINK_NOFOLLOW) == 0;
  if (exists && S_ISLNK(link.st_mode)) {
    if (kind == FolderKind::kPrivate) return OwnFolder::Refused(path + " is a link, not a folder");
    if (link.st_uid != geteuid() && link.st_uid != 0) {
      return OwnFolder::Refused(path + " is a link made by uid " + std::to_string(link.st_uid) +
                                ", not by this user");
    }
  }
  if (!exists) {
    if (!create) return OwnFolder::Refused(path + " does not exist");
    if (mkdirat(parent, name.c_str(), 0700) != 0 && errno != EEXIST) {
      return OwnFolder::Refused("cannot make " + path + ": " + std::strerror(errno));
    }
  }
  const int flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC |
                    (kind == FolderKind::kPrivate ? O_NOFOLLOW : 0);
  const int fd = openat(parent, name.c_str(), flags);
  if (fd < 0) {
    return OwnFolder::Refused(errno == ELOOP ? path + " is a link, not a folder"
                                             : path + ": " + std::strerror(errno));
  }
  OwnFolder folder = OwnFolder::Opened(fd);
  const std::string problem = FolderProblem(fd, path, kind);
  return problem.empty() ? std::move(folder) : OwnFolder::Refused(problem);
}

// The user's folder in the shared temporary directory `temp`: <temp>/mpicoll-<uid>.
inline std::string PrivateRootIn(const std::string& temp) {
  return temp + "/mpicoll-" + std::to_string(geteuid());
}

// Opens `path` for writing: a private folder (`private_root` itself or below
// it, every step held to the private rule) or a folder the user named.
inline OwnFolder OpenOwnFolder(const std::string& path, const std::string& private_root,
                               bool create = true) {
  if (path.empty()) return OwnFolder::Refused("no folder");
  const bool is_private = !private_root.empty() &&
      (path == private_root || path.compare(0, private_root.size() + 1, private_root + "/") == 0);
  if (!is_private) return OpenFolderAt(AT_FDCWD, path, path, FolderKind::kNamed, create);
  OwnFolder folder = OpenFolderAt(AT_FDCWD, private_root, private_root, FolderKind::kPrivate,
                                  create);
  std::string so_far = private_root;
  size_t at = private_root.size();
  while (folder.ok() && at < path.size()) {
    const size_t next = std::min(path.find('/', at + 1), path.size());
    const std::string part = path.substr(at + 1, next - at - 1);
    at = next;
    if (part.empty()) continue;
    so_far += "/" + part;
    folder = OpenFolderAt(folder.fd(), part, so_far, FolderKind::kPrivate, create);
  }
  return folder;
}

// Writes `text` to `name` in the open folder: a fresh temporary file, renamed
// over the name; "" or why not.
inline std::string WriteFileIn(const OwnFolder& folder, const std::string& path,
                               const std::string& name, const std::string& text) {
  static std::atomic<uint64_t> files_made{0};
  int fd = -1;
  std::string partial;
  // Another user cannot make names in a private folder; in a shared one they
  // can (a named /tmp), and a taken name only costs another try.
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    const uint64_t serial = files_made.fetch_add(1);
    partial = "." + name + "." + std::to_string(getpid()) + "." +
              std::to_string(static_cast<uint64_t>(std::time(nullptr)) ^ (serial << 20)) +
              ".partial";
    fd = openat(folder.fd(), partial.c_str(),
                O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) {
      return "cannot write in " + path + ": " + std::strerror(errno);
    }
  }
  if (fd < 0) return "cannot write in " + path + ": every temporary name was taken";
  bool written = true;
  for (size_t done = 0; done < text.size() && written;) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    written = n > 0;
    if (written) done += static_cast<size_t>(n);
  }
  const int write_error = written ? 0 : errno;
  if (close(fd) != 0 && written) written = false;
  if (!written || renameat(folder.fd(), partial.c_str(), folder.fd(), name.c_str()) != 0) {
    const std::string why = std::strerror(written ? errno : write_error);
    unlinkat(folder.fd(), partial.c_str(), 0);
    return "cannot write " + path + "/" + name + ": " + why;
  }
  return std::string();
}

// Whether `name` in the open folder is a file written in the last `seconds`.
inline bool WrittenWithinIn(const OwnFolder& folder, const std::string& name, double seconds) {
  struct stat info;
  if (!folder.ok() || fstatat(folder.fd(), name.c_str(), &info, AT_SYMLINK_NOFOLLOW) != 0) {
    return false;
  }
  return S_ISREG(info.st_mode) && std::difftime(std::time(nullptr), info.st_mtime) <= seconds;
}

}  // namespace mpicoll
