import random

from flock.sched.waiting_groups import WaitingGroups


def test_largest_group_and_its_oldest_member_match_brute_force():
    rng = random.Random(0)
    groups, waiting, arrival = WaitingGroups(), {}, 0
    for _ in range(2000):
        if waiting and rng.random() < 0.45:
            req = rng.choice(list(waiting))
            groups.remove(waiting.pop(req))
        else:
            req = (arrival, rng.randrange(6))
            arrival += 1
            waiting[req] = req[1]
            groups.add(req[1], req)
        counts = {}
        for r, g in waiting.items():
            counts[g] = counts.get(g, 0) + 1
        got = groups.oldest_of_largest(lambda r: r in waiting)
        if not counts or max(counts.values()) < 2:
            assert got is None
            continue
        top = max(counts.values())
        assert counts[got[1]] == top
        assert got == min(r for r, g in waiting.items() if g == got[1])
    assert len(groups.heap) <= 4 * len(groups.count) + 65
