"""The collectives, each family's specs beside its public functions (collectives.py:
the rank-block ones; vector.py; p2p.py), and their ranks x devices forms
(ranks_devices.py; local_meeting.py: the local devices' meeting).
"""
