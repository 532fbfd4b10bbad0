"""The collectives: the public functions (collectives.py, vector.py, p2p.py), the
specs of the rank-block collectives (blocks.py), and their ranks x devices forms
(ranks_devices.py; local_meeting.py: the local devices' meeting).
"""
