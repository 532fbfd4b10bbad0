// Where this process's Python threads are, read by the watchdog thread for a
// report (rank_state.h): the innermost frames of the main thread, and of any
// other thread inside JAX, each with its source line.
//
// Read without the GIL, the way faulthandler's dump_traceback_later reads them
// from its own watchdog thread: CPython's _Py_DumpTracebackThreads walks every
// thread's frames and writes them to a file descriptor, taking no lock.  So a
// rank whose main thread holds the GIL in a C extension (a long BLAS call, a
// ctypes.PyDLL function) still answers.  The function is looked up at run time
// (dlsym): a Python that does not export it gets a line saying so instead.
// Read for reports and on request only, never for the watchdog's probes.  The
// walk takes no lock, so it races with the threads it reads: see ReadGuarded.
#pragma once

#include <dlfcn.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mpicoll {

// Set at import, with the GIL (module_watch.cc): the interpreter, and the main
// thread's identifier as faulthandler prints it (threading.main_thread().ident).
struct WatchedPython {
  std::atomic<void*> interpreter{nullptr};
  std::atomic<unsigned long> main_thread{0};
  std::string package_dir;  // "/.../mpicoll/": its frames are left out (set once)
};
inline WatchedPython watched_python;

constexpr int kMainThreadFrames = 4;    // innermost frames shown for the main thread
constexpr int kOtherThreadFrames = 2;   // and for each other thread inside JAX
constexpr int kOtherThreadsShown = 2;
constexpr size_t kStackTextLimit = 2048;  // bytes on the wire per rank

struct PythonFrame {
  std::string file;
  std::string line;  // as printed: a number, or "???"
  std::string function;
};

struct PythonThread {
  unsigned long ident = 0;
  std::vector<PythonFrame> frames;  // innermost first
};

// faulthandler's text: "Thread 0x7f.. (most recent call first):" (or "Current
// thread 0x.."), then one `  File "f", line N in fn` per frame.
inline std::vector<PythonThread> ParseThreadDump(const std::string& dump) {
  std::vector<PythonThread> threads;
  size_t at = 0;
  while (at < dump.size()) {
    size_t end = dump.find('\n', at);
    if (end == std::string::npos) end = dump.size();
    const std::string line = dump.substr(at, end - at);
    at = end + 1;
    const size_t hex = line.find("hread 0x");
    if (hex != std::string::npos && line.find("File \"") == std::string::npos) {
      threads.emplace_back();
      threads.back().ident = std::strtoul(line.c_str() + hex + 6, nullptr, 16);
      continue;
    }
    const size_t open = line.find("File \"");
    if (open == std::string::npos || threads.empty()) continue;
    const size_t close = line.find("\", line ", open + 6);
    if (close == std::string::npos) continue;
    PythonFrame frame;
    frame.file = line.substr(open + 6, close - open - 6);
    const size_t number = close + 8, in = line.find(" in ", number);
    frame.line = line.substr(number, in == std::string::npos ? std::string::npos : in - number);
    if (in != std::string::npos) frame.function = line.substr(in + 4);
    threads.back().frames.push_back(std::move(frame));
  }
  return threads;
}

// The source line `number` of `file`, trimmed ("" where it cannot be read).
inline std::string SourceLine(const std::string& file, const std::string& number) {
  const long wanted = std::strtol(number.c_str(), nullptr, 10);
  if (wanted <= 0) return std::string();
  std::ifstream in(file);
  std::string text;
  for (long n = 1; n <= wanted && std::getline(in, text); ++n) {
    if (n == wanted) {
      const size_t first = text.find_first_not_of(" \t");
      if (first == std::string::npos) return std::string();
      text = text.substr(first);
      while (!text.empty() && (text.back() == ' ' || text.back() == '\r')) text.pop_back();
      return text.size() > 80 ? text.substr(0, 77) + "..." : text;
    }
  }
  return std::string();
}

// A frame's file as a reader wants it: from the package on in site-packages,
// else relative to the process's working directory where it lies below it.
inline std::string ShortPath(const std::string& file) {
  const std::string packages = "-packages/";
  const size_t at = file.rfind(packages);
  if (at != std::string::npos) return file.substr(at + packages.size());
  char cwd[4096];
  if (getcwd(cwd, sizeof(cwd))) {
    const std::string prefix = std::string(cwd) + "/";
    if (file.compare(0, prefix.size(), prefix) == 0) return file.substr(prefix.size());
  }
  return file;
}

inline bool InsideMpicoll(const PythonFrame& f) {
  return !watched_python.package_dir.empty() &&
         f.file.compare(0, watched_python.package_dir.size(), watched_python.package_dir) == 0;
}

inline bool InsideJax(const PythonFrame& f) {
  return f.file.find("/jax/") != std::string::npos || f.file.find("/jaxlib/") != std::string::npos;
}

inline std::string FrameLine(const PythonFrame& f) {
  std::string text = "      " + ShortPath(f.file) + ":" + f.line + " in " + f.function;
  const std::string source = SourceLine(f.file, f.line);
  return text + (source.empty() ? "" : ": " + source) + "\n";
}

inline bool ThreadInsideJax(const PythonThread& thread) {
  for (const PythonFrame& f : thread.frames) {
    if (InsideJax(f)) return true;
  }
  return false;
}

// The innermost frames a reader wants: mpicoll's own left out (the report
// names a rank's collective already), of JAX's only the innermost (where it
// is: dispatching, compiling, waiting), then `most` frames of the code that
// called them.
inline std::string FramesText(const PythonThread& thread, int most) {
  const std::vector<PythonFrame>& frames = thread.frames;
  if (frames.empty()) return "      (no Python frame)\n";
  std::string text;
  size_t at = 0;
  while (at < frames.size() && InsideMpicoll(frames[at])) ++at;
  if (at == frames.size()) at = 0;  // all of it mpicoll's: show it
  if (at > 0) text += "      (" + std::to_string(at) + " frames inside mpicoll)\n";
  if (at < frames.size() && InsideJax(frames[at])) {
    text += FrameLine(frames[at++]);
    size_t library = 0;
    while (at + library < frames.size() &&
           (InsideJax(frames[at + library]) || InsideMpicoll(frames[at + library]))) {
      ++library;
    }
    if (at + library < frames.size() && library > 0) {  // user code calls it: go there
      text += "      (" + std::to_string(library) + " more frames inside JAX)\n";
      at += library;
    }
  }
  for (size_t i = at; i < frames.size() && i < at + most; ++i) text += FrameLine(frames[i]);
  return text;
}

// Reading another thread's frames without the GIL races with that thread: a
// frame popped meanwhile may free its data-stack chunk (a deep recursion
// returning), a thread that ends frees its thread state, and the walk then
// reads unmapped memory.  A reader against recursion and threads coming and
// going crashed the process within 2 s (tests/programs/stack_reads.py).  So the
// read runs under a fault guard: while it runs, SIGSEGV or SIGBUS on the
// reading thread jumps back out of it and the read is tried again.  Jumping out
// is sound because the walk is written to run in a signal handler
// (faulthandler's): it takes no lock and allocates nothing.  A fault on any
// other thread meanwhile puts the previous handlers back and meets them (the
// faulting instruction runs again, a sent signal is sent again), as if the
// guard had not been there.
struct FaultGuard {
  std::mutex one_reader;           // the watchdog, or python_stacks() from Python
  std::atomic<pid_t> reader{0};    // the reading thread's id while it reads
  sigjmp_buf back;
  struct sigaction previous_segv = {}, previous_bus = {};
};
inline FaultGuard fault_guard;

inline void RestoreFaultHandlers() {
  sigaction(SIGSEGV, &fault_guard.previous_segv, nullptr);
  sigaction(SIGBUS, &fault_guard.previous_bus, nullptr);
}

inline void OnReadFault(int signal, siginfo_t* info, void*) {
  if (static_cast<pid_t>(syscall(SYS_gettid)) == fault_guard.reader.load()) {
    siglongjmp(fault_guard.back, 1);
  }
  RestoreFaultHandlers();
  if (info->si_code <= 0) raise(signal);  // sent by a process, not met: send it again
}

using DumpThreads = const char* (*)(int, void*, void*);

// One walk of every thread into `fd`; false: it faulted (fd holds part of it).
inline bool ReadGuarded(DumpThreads dump, int fd, void* interpreter, const char** error) {
  std::lock_guard<std::mutex> one_at_a_time(fault_guard.one_reader);
  struct sigaction guard = {};
  sigemptyset(&guard.sa_mask);
  guard.sa_flags = SA_SIGINFO;
  guard.sa_sigaction = OnReadFault;
  sigaction(SIGSEGV, &guard, &fault_guard.previous_segv);
  sigaction(SIGBUS, &guard, &fault_guard.previous_bus);
  volatile bool walked = false;
  if (sigsetjmp(fault_guard.back, /*savemask=*/1) == 0) {
    fault_guard.reader.store(static_cast<pid_t>(syscall(SYS_gettid)));
    *error = dump(fd, interpreter, nullptr);
    walked = true;
  }
  fault_guard.reader.store(0);
  RestoreFaultHandlers();
  return walked;
}

constexpr int kStackReadTries = 3;  // a thread busy in Python moves on between tries

// faulthandler's dump of every thread of the interpreter, into a memory file.
inline std::string DumpPythonThreads(std::string* why_not) {
  static const DumpThreads dump =
      reinterpret_cast<DumpThreads>(dlsym(RTLD_DEFAULT, "_Py_DumpTracebackThreads"));
  void* interpreter = watched_python.interpreter.load();
  if (!dump || !interpreter) {
    *why_not = dump ? "not set up" : "this Python does not export _Py_DumpTracebackThreads";
    return std::string();
  }
  const int fd = memfd_create("mpicoll-python-stacks", 0);
  if (fd < 0) {
    *why_not = "no memory file";
    return std::string();
  }
  const char* error = nullptr;
  bool walked = false;
  for (int attempt = 0; attempt < kStackReadTries && !walked; ++attempt) {
    if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (ftruncate(fd, 0) != 0 || lseek(fd, 0, SEEK_SET) != 0) break;
    walked = ReadGuarded(dump, fd, interpreter, &error);
  }
  std::string text;
  if (walked && lseek(fd, 0, SEEK_SET) == 0) {
    char buffer[4096];
    ssize_t got;
    while ((got = read(fd, buffer, sizeof(buffer))) > 0) text.append(buffer, got);
  }
  close(fd);
  if (!walked) {
    *why_not = "it changed under each of " + std::to_string(kStackReadTries) + " reads";
  } else if (error && text.empty()) {
    *why_not = error;
  }
  return text;
}

// Where the main thread is in the user's code, "file:line (function)", while it
// is inside mpicoll or JAX ("" where it is not, or cannot be read).  An eager
// call blocks the thread that made it, and JAX caches an eager call's program
// by signature, so its lowered site names the first caller's line: this is the
// line of the call that waits now.
inline std::string MainThreadCallerLine() {
  std::string why_not;
  const unsigned long main_ident = watched_python.main_thread.load();
  for (const PythonThread& thread : ParseThreadDump(DumpPythonThreads(&why_not))) {
    if (thread.ident != main_ident || thread.frames.empty()) continue;
    const PythonFrame& innermost = thread.frames.front();
    if (!InsideMpicoll(innermost) && !InsideJax(innermost)) return std::string();
    for (const PythonFrame& f : thread.frames) {
      if (!InsideMpicoll(f) && !InsideJax(f)) {
        return f.file + ":" + f.line + " (" + f.function + ")";
      }
    }
  }
  return std::string();
}

// The report's lines for this process's Python threads (innermost frame first).
inline std::string PythonStacks() {
  std::string why_not;
  const std::vector<PythonThread> threads = ParseThreadDump(DumpPythonThreads(&why_not));
  if (threads.empty()) {
    return "    its Python stack cannot be read (" + (why_not.empty() ? "no thread" : why_not) +
           ")\n";
  }
  std::string text;
  const unsigned long main_ident = watched_python.main_thread.load();
  int others = 0;
  for (const PythonThread& thread : threads) {
    if (thread.ident == main_ident) {
      text = "    Python, main thread (innermost first):\n" +
             FramesText(thread, kMainThreadFrames) + text;
    } else if (ThreadInsideJax(thread) && others < kOtherThreadsShown) {
      char head[96];
      std::snprintf(head, sizeof(head), "    Python, thread 0x%lx (inside JAX):\n", thread.ident);
      text += head + FramesText(thread, kOtherThreadFrames);
      ++others;
    }
  }
  if (text.empty()) text = "    its Python main thread has no frame (it is finishing)\n";
  if (text.size() > kStackTextLimit) text = text.substr(0, kStackTextLimit - 4) + "...\n";
  return text;
}

}  // namespace mpicoll
