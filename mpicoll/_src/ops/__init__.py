"""The public functions, each beside what defines it: the collectives, each
family's specs beside its functions (collectives.py: the rank-block ones;
vector.py; p2p.py), their ranks x devices forms (ranks_devices.py;
local_meeting.py: the local devices' meeting), the typed ranks' mesh and
autodiff mode (typed_ranks.py), and how collectives are scheduled: overlap and
the dispatch order (scheduling.py).
"""
