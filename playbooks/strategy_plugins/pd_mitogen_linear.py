"""The pd_mitogen_linear strategy: Mitogen's linear strategy over pd_linear (a worker forked
from a frozen heap; pd_linear.py says why). pdctl's long runs (deploy, destroy) use it:
pdctl/doors/runner.py puts Mitogen's strategy plugins and these on the strategy path."""

from __future__ import annotations

import ansible_mitogen.loaders
import ansible_mitogen.strategy

DOCUMENTATION = """
name: pd_mitogen_linear
short_description: Mitogen's linear strategy over pd_linear
description:
  - Mitogen's strategy mixin (one interpreter per host, kept across tasks) over pd_linear.
author: pdctl
"""

_Base = ansible_mitogen.loaders.strategy_loader.get("pd_linear", class_only=True)


class StrategyModule(ansible_mitogen.strategy.StrategyMixin, _Base):  # type: ignore[misc,valid-type]
    pass
