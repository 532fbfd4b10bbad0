"""Seeing a job fail and stall: abort on error, checks across ranks and the timeout
(failures.py); the flight recorder's dumps and the timeline (records.py).
"""
