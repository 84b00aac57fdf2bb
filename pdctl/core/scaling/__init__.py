"""The scaler's pure parts: its signals read from metrics, its policy, its memory of hosts.

The daemon that observes, acts and records around them is pdctl/scaler/.
"""
