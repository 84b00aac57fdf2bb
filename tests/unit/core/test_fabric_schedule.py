"""pdctl/core/fabric_schedule.py: the round-robin tournament, rails, waves, samples."""

from __future__ import annotations

import itertools

import pytest

from pdctl.core import fabric_schedule
from pdctl.core.fabric_nics import FabricNic
from pdctl.core.fabric_schedule import Link, circle_rounds, mesh, pack, rail_numbers, waves


def hosts(n: int) -> list[str]:
    return [f"node{i}" for i in range(1, n + 1)]


def nics(count: int = 8, prefix: str = "bnxt_re", skip: tuple[int, ...] = ()) -> list[FabricNic]:
    return [FabricNic(f"{prefix}{k}", rate_gbps=400.0) for k in range(count) if k not in skip]


def check_tournament(names: list[str], rounds: list[list[tuple[str, str]]]) -> None:
    seen = [frozenset(pair) for r in rounds for pair in r]
    assert len(seen) == len(set(seen)), "a pair twice"
    assert set(seen) == {frozenset(p) for p in itertools.combinations(names, 2)}, "a pair missing"
    for r in rounds:
        busy = [h for pair in r for h in pair]
        assert len(busy) == len(set(busy)), f"a host twice in round {r}"


@pytest.mark.parametrize("n", range(2, 20))
def test_circle_method_every_pair_once_no_host_twice(n: int) -> None:
    names = hosts(n)
    rounds = circle_rounds(names)
    check_tournament(names, rounds)
    # N-1 rounds of N/2 pairs; N odd: N rounds, one host sits each round out (the bye).
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    assert all(len(r) == n // 2 for r in rounds)
    if n % 2:
        out = [next(h for h in names if all(h not in p for p in r)) for r in rounds]
        assert sorted(out) == sorted(names)  # each host has its bye once


def test_fewer_than_two_hosts_make_no_rounds() -> None:
    assert circle_rounds([]) == [] and circle_rounds(["a"]) == []


def test_pack_keeps_a_full_tournament_as_short_and_packs_a_subset() -> None:
    names = hosts(8)
    rounds = circle_rounds(names)
    assert pack(p for r in rounds for p in r) == rounds
    some = [p for r in rounds for p in r if "node3" in p]
    packed = pack(some)
    assert len(packed) == 7  # node3 is in each: one round each, none shorter possible
    for r in packed:
        busy = [h for pair in r for h in pair]
        assert len(busy) == len(set(busy))


def test_rails_by_number_leave_a_gap_for_a_missing_nic() -> None:
    by_rail = rail_numbers(nics(skip=(3,)))
    assert sorted(by_rail) == [0, 1, 2, 4, 5, 6, 7]
    assert by_rail[4].name == "bnxt_re4"
    assert [n.name for n in rail_numbers(nics(4, "mlx5_")).values()] == [
        f"mlx5_{k}" for k in range(4)
    ]
    udev = [FabricNic(name) for name in ("rocep65s0f0", "rocep1s0f1", "rocep1s0f0")]
    assert [n.name for n in rail_numbers(udev).values()] == [
        "rocep1s0f0",
        "rocep1s0f1",
        "rocep65s0f0",
    ]


def test_mesh_rail_by_rail() -> None:
    fleet = {name: nics() for name in hosts(4)}
    schedule = mesh(fleet)
    assert schedule.full_mesh and len(schedule.rounds) == 3
    for round_waves in schedule.rounds:
        assert len(round_waves) == 8  # one wave per rail
        for rail, wave in enumerate(round_waves):
            assert {link.rail for link in wave} == {str(rail)}
            busy = [h for link in wave for h in link.pair]
            assert len(busy) == len(set(busy))
            assert all(
                link.client_nic and link.client_nic.name == f"bnxt_re{rail}" for link in wave
            )
    links = schedule.links()
    assert len(links) == 6 * 8
    assert len(schedule.pairs()) == 6


def test_mesh_parallel_rails_use_each_nic_once_per_wave() -> None:
    schedule = mesh({name: nics() for name in hosts(5)}, parallel_rails=True)
    assert len(schedule.rounds) == 5
    for round_waves in schedule.rounds:
        assert len(round_waves) == 1
        used = [use for link in round_waves[0] for use in link.uses()]
        assert len(used) == len(set(used))


def test_mesh_chosen_rails_and_a_missing_nic() -> None:
    fleet = {name: nics() for name in hosts(3)}
    fleet["node2"] = nics(skip=(3,))
    schedule = mesh(fleet, rails=[3, 5])
    by_pair = {(link.pair, link.rail): link for link in schedule.links()}
    assert {rail for _, rail in by_pair} == {"3", "5"}
    broken = by_pair[(("node1", "node2"), "3")]
    assert broken.problem == "node2 has no NIC on rail 3" and broken.server_nic is None
    assert by_pair[(("node1", "node3"), "3")].problem is None
    assert mesh(fleet, rails=[9]).notes == ["no host has a NIC on rail 9"]


def test_only_the_pairs_of_some_hosts() -> None:
    schedule = mesh({name: nics(1) for name in hosts(6)}, only=["node2"])
    assert {frozenset(p) for p in schedule.pairs()} == {
        frozenset(p) for p in itertools.combinations(hosts(6), 2) if "node2" in p
    }
    assert len(schedule.rounds) == 5


def test_sample_takes_whole_rounds() -> None:
    names = hosts(10)
    fleet = {name: nics(1) for name in names}
    one = mesh(fleet, sample=0.5, seed=7)
    assert not one.full_mesh and len(one.rounds) == 5
    for round_waves in one.rounds:
        assert sorted(h for link in round_waves[0] for h in link.pair) == sorted(names)
    assert one.pairs() == mesh(fleet, sample=0.5, seed=7).pairs()  # the seed repeats it
    assert "seed 7" in one.notes[0]
    assert len(mesh(fleet, sample=0.01, seed=1).rounds) == fabric_schedule.MIN_SAMPLE_ROUNDS


def test_beyond_the_full_mesh_size_a_sample_by_default() -> None:
    fleet = {f"h{i}": nics(1) for i in range(fabric_schedule.FULL_MESH_MAX + 2)}
    schedule = mesh(fleet, seed=3)
    assert not schedule.full_mesh
    assert len(schedule.rounds) == pytest.approx(0.2 * 33, abs=1)
    assert mesh({f"h{i}": nics(1) for i in range(32)}).full_mesh


def test_kv_links_in_rounds_and_waves() -> None:
    nic = {k: FabricNic(f"bnxt_re{k}") for k in range(8)}
    links = [
        Link("p1", "d1", "a", nic[0], nic[4]),
        Link("p1", "d1", "b", nic[1], nic[5]),
        Link("p1", "d2", "c", nic[0], nic[4]),
        Link("p2", "d1", "d", nic[2], nic[6]),
        Link("p2", "d2", "e", nic[2], nic[4]),
    ]
    schedule = fabric_schedule.of_links(links, parallel=False)
    assert sorted(link.rail for link in schedule.links()) == ["a", "b", "c", "d", "e"]
    for round_waves in schedule.rounds:
        pairs = [link.pair for wave in round_waves for link in wave]
        busy = [h for pair in set(pairs) for h in pair]
        assert len(busy) == len(set(busy))
        for wave in round_waves:
            in_wave = [h for link in wave for h in link.pair]
            assert len(in_wave) == len(set(in_wave))
    parallel = fabric_schedule.of_links(links, parallel=True)
    for round_waves in parallel.rounds:
        for wave in round_waves:
            used = [use for link in wave for use in link.uses()]
            assert len(used) == len(set(used))


def test_waves_serial_one_test_per_host() -> None:
    nic = FabricNic("x0")
    links = [
        Link("a", "b", "0", nic, nic),
        Link("a", "b", "1", nic, nic),
        Link("c", "d", "0", nic, nic),
    ]
    assert [[link.rail for link in wave] for wave in waves(links, parallel=False)] == [
        ["0", "0"],
        ["1"],
    ]
