"""The pure core: what pdctl computes from data, touching no host, no network and no Ansible.

The spec (pd.yml) and the plan it becomes, the hosts' layout, their stored facts read and
checked, the worker commands' shell parsing, the scaler's policy, the fabric check's schedule
and verdicts, the commands' typed results. Every module here is pure by the import contract
in .importlinter (a new one is too, by default): it imports no door (SSH, Ansible, HTTP,
sockets, subprocesses), no operation, no command line and no lab, so it is tested without
any of them.
"""
