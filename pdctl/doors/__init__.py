"""pdctl's doors: every way out of the process, one module each.

SSH (ssh.py, the only one that opens SSH), Ansible (runner.py, the only one that starts it),
SMG's HTTP API (router.py), the model hub's file lists (model_list.py), the fleets'
inventories (inventory.py), the workspace's files (workspace.py, service.py), the Ansible
content (content.py), and a deployed service's slots (slots.py: SSH and the router together).
Operations (pdctl/operations/) and the scaler (pdctl/scaler/) go through these; the core
(pdctl/core/) never does.
"""
