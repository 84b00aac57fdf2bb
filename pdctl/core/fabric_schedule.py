"""Which host pairs the fabric check tests, on which NICs, and in what order. PURE.

Pairs go in rounds of a round-robin tournament (the circle method): N-1 rounds for N hosts
(N odd: one host sits each round out), every pair exactly once, no host in two pairs of a
round, so a round's pairs run at the same time without one host's NIC or CPU serving two
tests. Within a round the tests go in waves: rail by rail (every pair of the round on NIC
0, then on NIC 1, ...), or with ``parallel_rails`` every rail at once, where the NICs are
distinct (no NIC in two tests of a wave).

A fleet beyond ``FULL_MESH_MAX`` hosts (or any, with a sample fraction) tests a sample: a
random choice of whole rounds, so every host is still in one pair per chosen round and is
compared with several peers, which is what naming a bad host needs.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pdctl.core.fabric_nics import FabricNic
from pdctl.core.fleet_model import natural_key

FULL_MESH_MAX = 32
DEFAULT_SAMPLE = 0.2
MIN_SAMPLE_ROUNDS = 3
_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)\Z")


@dataclass(frozen=True)
class Link:
    """One test: perftest's client on ``client``'s NIC writes to its server on ``server``'s.
    ``problem``: why it cannot run at all (a NIC missing on one side), judged failed as is."""

    client: str
    server: str
    rail: str  # "0", "1", ... for the mesh; "prefill/0>decode/1 #0" for a KV path
    client_nic: FabricNic | None
    server_nic: FabricNic | None
    problem: str | None = None

    @property
    def pair(self) -> tuple[str, str]:
        return (self.client, self.server)

    def uses(self) -> set[tuple[str, str]]:
        """The (host, NIC) this test occupies."""
        return {
            (host, nic.name)
            for host, nic in ((self.client, self.client_nic), (self.server, self.server_nic))
            if nic is not None
        }


@dataclass
class Schedule:
    rounds: list[list[list[Link]]]  # round -> wave -> tests that run at once
    hosts: list[str]
    full_mesh: bool
    seed: int | None = None
    notes: list[str] = field(default_factory=list)

    def links(self) -> list[Link]:
        return [link for waves in self.rounds for wave in waves for link in wave]

    def pairs(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys(link.pair for link in self.links()))


def circle_rounds(hosts: Sequence[str]) -> list[list[tuple[str, str]]]:
    """The round-robin tournament of ``hosts`` by the circle method: the first host stays,
    the others turn one place a round; round r pairs position i with position n-1-i."""
    players: list[str | None] = list(hosts)
    if len(players) < 2:
        return []
    if len(players) % 2:
        players.append(None)  # the bye
    n = len(players)
    rounds = []
    for _ in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = players[i], players[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((a, b))
        rounds.append(pairs)
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def pack(pairs: Iterable[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Pairs into rounds in the order given, each into the first round where neither host
    is busy (a subset of a tournament stays as short as it can be, in the same order)."""
    rounds: list[list[tuple[str, str]]] = []
    busy: list[set[str]] = []
    for a, b in pairs:
        for index, hosts in enumerate(busy):
            if a not in hosts and b not in hosts:
                rounds[index].append((a, b))
                hosts.update((a, b))
                break
        else:
            rounds.append([(a, b)])
            busy.append({a, b})
    return rounds


def rail_numbers(nics: Sequence[FabricNic]) -> dict[int, FabricNic]:
    """A host's NICs by rail: the number its name ends in when all share one stem (bnxt_re3,
    mlx5_3: rail 3, so a missing NIC leaves a gap instead of shifting the others), else
    their position in name order (udev names such as rocep1s0f1)."""
    matches = [_TRAILING_NUMBER.match(nic.name) for nic in nics]
    stems = {m.group(1) for m in matches if m}
    if nics and all(matches) and len(stems) == 1:
        numbered = {int(m.group(2)): nic for m, nic in zip(matches, nics, strict=True) if m}
        if len(numbered) == len(nics):
            return dict(sorted(numbered.items()))
    ordered = sorted(nics, key=lambda nic: natural_key(nic.name))
    return dict(enumerate(ordered))


def _pair_links(
    a: str,
    b: str,
    rails_a: Mapping[int, FabricNic],
    rails_b: Mapping[int, FabricNic],
    rails: list[int],
) -> list[Link]:
    links = []
    for rail in rails:
        nic_a, nic_b = rails_a.get(rail), rails_b.get(rail)
        if nic_a is None and nic_b is None:
            continue
        problem = None
        if nic_a is None or nic_b is None:
            missing = a if nic_a is None else b
            problem = f"{missing} has no NIC on rail {rail}"
        links.append(Link(a, b, str(rail), nic_a, nic_b, problem))
    return links


def waves(links: Sequence[Link], *, parallel: bool) -> list[list[Link]]:
    """The tests of one round in waves: one test per host at a time (rail by rail), or,
    ``parallel``, one per NIC at a time. Order is kept (rail 0 first)."""
    found: list[list[Link]] = []
    busy: list[set[tuple[str, str]]] = []
    for link in links:
        keys = link.uses() if parallel else {(host, "") for host in link.pair}
        for index, taken in enumerate(busy):
            if not keys & taken:
                found[index].append(link)
                taken.update(keys)
                break
        else:
            found.append([link])
            busy.append(set(keys))
    return found


def _sampled(
    rounds: list[list[tuple[str, str]]], fraction: float, rng: random.Random
) -> list[list[tuple[str, str]]]:
    keep = max(min(MIN_SAMPLE_ROUNDS, len(rounds)), math.ceil(fraction * len(rounds)))
    chosen = sorted(rng.sample(range(len(rounds)), min(keep, len(rounds))))
    return [rounds[index] for index in chosen]


def mesh(
    hosts: Mapping[str, Sequence[FabricNic]],
    *,
    rails: Sequence[int] | None = None,
    sample: float | None = None,
    only: Iterable[str] | None = None,
    parallel_rails: bool = False,
    seed: int | None = None,
) -> Schedule:
    """Every pair of ``hosts`` (a sample beyond FULL_MESH_MAX, or with ``sample``), on every
    rail (or ``rails``); ``only``: just the pairs with one of these hosts in them."""
    names = sorted(hosts, key=natural_key)
    numbered = {name: rail_numbers(hosts[name]) for name in names}
    every_rail = sorted({rail for by_rail in numbered.values() for rail in by_rail})
    chosen_rails = every_rail if rails is None else sorted(set(rails))
    notes = []
    absent = [rail for rail in chosen_rails if rail not in every_rail]
    if absent:
        notes.append(f"no host has a NIC on rail {', '.join(map(str, absent))}")
    rounds = circle_rounds(names)
    full = sample is None and len(names) <= FULL_MESH_MAX
    rng = random.Random(seed)  # noqa: S311 - picks which pairs to test, not a secret
    if not full:
        fraction = DEFAULT_SAMPLE if sample is None else sample
        rounds = _sampled(rounds, fraction, rng)
        notes.append(
            f"sampled {len(rounds)} of {max(len(names) - 1, 0)} rounds "
            f"({sum(map(len, rounds))} pairs; --sample {fraction:g}, seed {seed})"
        )
    wanted = set(only) if only is not None else None
    pairs = [
        pair
        for tournament_round in rounds
        for pair in tournament_round
        if wanted is None or wanted & set(pair)
    ]
    scheduled = []
    for tournament_round in pack(pairs) if wanted is not None else rounds:
        links = [
            link
            for a, b in tournament_round
            for link in _pair_links(
                a, b, numbered[a], numbered[b], [r for r in chosen_rails if r in every_rail]
            )
        ]
        links.sort(key=lambda link: int(link.rail))  # rail 0 of every pair first
        if links:
            scheduled.append(waves(links, parallel=parallel_rails))
    return Schedule(rounds=scheduled, hosts=names, full_mesh=full, seed=seed, notes=notes)


def of_links(links: Sequence[Link], *, parallel: bool) -> Schedule:
    """Given tests (the KV paths of a plan) in rounds: their host pairs in tournament order,
    packed, each round's tests in waves."""
    hosts = sorted({h for link in links for h in link.pair}, key=natural_key)
    order = {pair: i for i, pair in enumerate(p for r in circle_rounds(hosts) for p in r)}

    def position(pair: tuple[str, str]) -> int:
        return order.get(pair, order.get((pair[1], pair[0]), len(order)))

    by_pair: dict[tuple[str, str], list[Link]] = {}
    for link in links:
        by_pair.setdefault(link.pair, []).append(link)
    rounds = pack(sorted(by_pair, key=position))
    scheduled = []
    for tournament_round in rounds:
        round_links = [link for pair in tournament_round for link in by_pair[pair]]
        scheduled.append(waves(round_links, parallel=parallel))
    return Schedule(rounds=scheduled, hosts=hosts, full_mesh=True)
