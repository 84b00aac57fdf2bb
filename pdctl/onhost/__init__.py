"""Code that runs on the hosts: standard library only, Python 3.9, importing only itself.

Each module here is either an entry that a host runs (hardware collection and the preflight,
the drift and holdings probes, the model and image fetchers, the unit probe, the router's
launcher) or what such an entry imports. pdctl ships them one way (bundle.py): the entry and
what it imports of this package, as ``{module name: source}``, read by a small loader
(loader.py) that makes them importable as themselves, so ``import pdctl.onhost.x`` works the
same on a host as on the controller. The controller imports the pure ones too (parsers, the
hub layout, the secret masker, the gRPC health call). The import contracts in .importlinter
hold this package to the standard library and itself.
"""
