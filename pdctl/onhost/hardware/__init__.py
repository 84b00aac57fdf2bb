"""What a GPU host looks like: observe it (on the host), parse what its tools print, summarise,
check.

- collect.py     runs on the host: the tools, a few files, sysfs, peers -> a Raw document
- documents.py   the Raw and Facts documents' shapes
- ibverbs.py, amd.py, nvidia.py, runtime.py, pci.py
                 one parser module per tool family
- facts.py       Raw -> Facts, the summary pdctl stores (pdctl/core/host_devices.py reads it)
- checks.py      Raw + Expectations -> the preflight's named verdicts
- preflight.py   runs on the host for the pd_preflight role: collect, then checks and facts

Standard library only and Python 3.9 (pdctl/onhost/__init__.py): the preflight runs all of it on
the hosts, and pdctl's own fact gathering ships collection alone. This package's __init__
imports nothing, so a bundle holds only what its entry imports.
"""
