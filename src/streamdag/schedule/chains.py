"""Stream assignment: a minimum chain cover of the DAG, then merged to the stream budget.

1. Maximum bipartite matching (Hopcroft-Karp) on the *transitive reduction*,
   as Nimble does: every matched edge ``u -> v`` puts ``v`` right after ``u``
   on one stream, so it needs no event wait. This is a minimum path cover:
   the fewest cross-stream edges.
2. Augmenting paths over the *transitive closure* (the reach bit sets) then
   join paths whose end precedes another path's start, until the number of
   chains equals the width of the DAG (Dilworth). Bounded by
   ``closure_limit`` ops: on larger graphs step 2 is skipped and the path
   cover is used as it is.
3. Chains are merged down to ``max_streams`` streams: a chain goes after a
   stream whose last op already precedes its first (no concurrency lost),
   else on a new stream while the budget lasts, else on the least loaded one.
   Each stream runs its ops in index order, which is a topological order, so
   no merge can deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_streams", "chains_from_matching", "match_closure", "match_paths"]


def match_paths(preds: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Hopcroft-Karp on edges ``u -> v``: returns ``(next_of, prev_of)``, -1 where unmatched."""
    n = len(preds)
    adj: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for u in ps:
            adj[u].append(v)
    match_l = [-1] * n
    match_r = [-1] * n
    for u in range(n):  # greedy start: most matches are found here
        for v in adj[u]:
            if match_r[v] == -1:
                match_l[u], match_r[v] = v, u
                break
    while True:
        dist = [-1] * n
        queue = [u for u in range(n) if match_l[u] == -1]
        for u in queue:
            dist[u] = 0
        found = False
        qi = 0
        while qi < len(queue):
            u = queue[qi]
            qi += 1
            for v in adj[u]:
                w = match_r[v]
                if w == -1:
                    found = True
                elif dist[w] == -1:
                    dist[w] = dist[u] + 1
                    queue.append(w)
        if not found:
            return match_l, match_r
        cursor = [0] * n
        for root in range(n):
            if match_l[root] != -1:
                continue
            stack = [root]
            path: list[int] = []
            while stack:
                u = stack[-1]
                edges = adj[u]
                moved = False
                while cursor[u] < len(edges):
                    v = edges[cursor[u]]
                    cursor[u] += 1
                    w = match_r[v]
                    if w == -1:
                        path.append(v)
                        for uu, vv in zip(stack, path):
                            match_l[uu], match_r[vv] = vv, uu
                        stack = []
                        moved = True
                        break
                    if dist[w] == dist[u] + 1:
                        path.append(v)
                        stack.append(w)
                        moved = True
                        break
                if not moved:
                    dist[u] = -2
                    stack.pop()
                    if path:
                        path.pop()


def match_closure(reach: Sequence[int], match_l: list[int], match_r: list[int]) -> None:
    """Grow a matching over the transitive closure in place (Kuhn's augmenting paths on bit sets)."""
    n = len(reach)
    free_right = 0
    for v in range(n):
        if match_r[v] == -1:
            free_right |= 1 << v
    for root in range(n):
        if match_l[root] != -1 or not reach[root]:
            continue
        visited = 0
        stack = [[root, reach[root]]]
        path: list[int] = []
        while stack:
            frame = stack[-1]
            cand = frame[1] & ~visited
            if not cand:
                stack.pop()
                if path:
                    path.pop()
                continue
            free = cand & free_right
            if free:
                v = (free & -free).bit_length() - 1
                path.append(v)
                for (uu, _), vv in zip(stack, path):
                    match_l[uu], match_r[vv] = vv, uu
                free_right &= ~(1 << v)
                break
            v = (cand & -cand).bit_length() - 1
            visited |= 1 << v
            frame[1] = cand & ~(1 << v)
            path.append(v)
            w = match_r[v]
            stack.append([w, reach[w]])


def chains_from_matching(match_l: Sequence[int], match_r: Sequence[int]) -> list[list[int]]:
    """Follow matched edges from every unmatched start: each chain in index order."""
    chains = []
    for start in range(len(match_l)):
        if match_r[start] != -1:
            continue
        chain = [start]
        while match_l[chain[-1]] != -1:
            chain.append(match_l[chain[-1]])
        chains.append(chain)
    return chains


def assign_streams(
    chains: list[list[int]],
    reach: Sequence[int],
    max_streams: int,
    costs: Sequence[float],
) -> list[int]:
    """Map chains onto at most ``max_streams`` streams; returns the stream of every op."""
    if max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, got {max_streams}")
    n = len(reach)
    stream_of = [0] * n
    tails: list[int] = []
    loads: list[float] = []
    for chain in sorted(chains, key=lambda c: (c[0], -len(c))):
        first = chain[0]
        following = [s for s, t in enumerate(tails) if (reach[t] >> first) & 1]
        if following:
            s = max(following, key=lambda s: tails[s])
        elif len(tails) < max_streams:
            s = len(tails)
            tails.append(-1)
            loads.append(0.0)
        else:
            s = min(range(len(tails)), key=lambda s: (loads[s], s))
        for v in chain:
            stream_of[v] = s
        tails[s] = max(tails[s], chain[-1])
        loads[s] += sum(costs[v] for v in chain)
    return stream_of
