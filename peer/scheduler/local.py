"""Local search operators of the genetic search, vectorised over groups.

Three operators, applied in this order to every individual (see `search` for why):

1. `fastest_link_pass`: Yuan et al.'s gain (arXiv 2206.01288, section 3.3). For groups a, b and
   u in a, v in b, the gain compares the fastest intra-group link of u and of v before the swap
   with their fastest link into the other group after it; the swap is made when it is positive.
2. `summed_link_pass`: Kernighan-Lin on the summed intra-group link costs, swapping *sets*.
3. `bottleneck_descent`: exact steepest descent on the true objective over swaps (and, when group
   sizes differ, moves) of the slowest group's worst-connected members.

Groups are held as a padded (G, s_max) member matrix so that one numpy call covers all of them;
group sizes differ by at most one, so the padding is at most one column.
"""

from __future__ import annotations

import numpy as np

from peer.scheduler.cost import ROW_BLOCK, CostModel

NEG = np.int64(-(2**60))
BIG = np.int64(2**60)


class State:
    """One partition plus cached per-peer sums, updated in O(N) per swap."""

    def __init__(self, model: CostModel, labels: np.ndarray):
        self.m = model
        self.labels = labels.copy()
        self.counts = np.bincount(labels, minlength=model.n_groups)
        # sums[g, i]: i's links into group g, at g's size. Groups are rows so that a swap updates
        # two contiguous rows; link matrices are symmetric, so their rows serve as columns too.
        self.sums = np.ascontiguousarray(model.group_sums(self.labels).T)
        self.group_tps = model.group_tps(self.labels)
        self.refresh()

    def refresh(self) -> None:
        """Recomputes the padded member matrix (after any change of labels)."""
        g = self.m.n_groups
        order = np.argsort(self.labels, kind="stable")
        self.valid = np.arange(int(self.counts.max())) < self.counts[:, None]
        self.mem = np.zeros(self.valid.shape, dtype=np.int64)
        self.mem[self.valid] = order
        self.lo, self.hi = int(self.counts.min()), int(self.counts.max())
        assert self.mem.shape[0] == g

    def links(self, rows, cols, groups, also=None) -> np.ndarray:
        """Link costs at the size of `groups` (broadcast with rows and cols); with `also`, the sum
        of the costs at the sizes of both groups. One gather per element whatever the sizes."""
        if self.hi == self.lo:
            out = self.m.links(self.lo)[rows, cols]
            return out if also is None else 2 * out
        rows, cols, groups = np.broadcast_arrays(rows, cols, groups)
        other = groups if also is None else np.broadcast_to(also, groups.shape)
        out = np.empty(rows.shape, dtype=np.int64)
        for x in (self.lo, self.hi):
            for y in (self.lo, self.hi) if also is not None else (None,):
                mask = self.counts[groups] == x
                if y is not None:
                    mask &= self.counts[other] == y
                r, c = rows[mask], cols[mask]
                if y is None:
                    out[mask] = self.m.links(x)[r, c]
                elif (pair := self.m.pair_links(x, y)) is not None:
                    out[mask] = pair[r, c]
                else:  # a large swarm: no cached sum, both sizes' costs gathered apiece
                    out[mask] = self.m.links(x)[r, c] + self.m.links(y)[r, c]
        return out

    def own(self) -> np.ndarray:
        return self.sums[self.labels, np.arange(self.m.n)]

    def gcost(self) -> np.ndarray:
        return self.m.group_costs(self.labels, self.sums.T)

    def objective(self, gc: np.ndarray | None = None) -> tuple[int, int]:
        gc = self.gcost() if gc is None else gc
        return self.m.compute_ns + int(gc.max(initial=0)) + int(self.m.balance_ns(self.group_tps)), int(
            gc.sum()
        )

    def swap(self, u: int, v: int) -> None:
        a, b = self.labels[u], self.labels[v]
        la, lb = self.m.links(int(self.counts[a])), self.m.links(int(self.counts[b]))
        self.sums[a] += la[v] - la[u]
        self.sums[b] += lb[u] - lb[v]
        self.labels[u], self.labels[v] = b, a
        delta = self.m.tps[v] - self.m.tps[u]
        self.group_tps[a] += delta
        self.group_tps[b] -= delta

    def move(self, u: int, b: int) -> None:
        """u joins b; sizes change, so the two groups' sums are recomputed at their new sizes."""
        a = int(self.labels[u])
        self.labels[u] = b
        self.counts[a] -= 1
        self.counts[b] += 1
        for grp in (a, b):
            ms = np.flatnonzero(self.labels == grp)
            self.sums[grp] = self.m.links(int(self.counts[grp]))[ms].sum(axis=0) + self.m.shared_ns
        self.group_tps[a] -= self.m.tps[u]
        self.group_tps[b] += self.m.tps[u]
        self.refresh()


def _best_pairs(st: State, score: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """best[a, b] = max over u in a of score[u, b], and that u."""
    s = np.where(st.valid[:, :, None], score[st.mem], NEG)  # (G, s_max, G)
    k = np.argmax(s, axis=1)
    return np.take_along_axis(s, k[:, None, :], axis=1)[:, 0, :], np.take_along_axis(st.mem, k, axis=1)


def _disjoint(gain: np.ndarray) -> list[tuple[int, int]]:
    """Each group's best partner, pairs by decreasing positive gain, each group used at most once
    (ties: lower pair). Only one candidate per group: the next pass finds what this one skipped."""
    g = gain.shape[0]
    sym = np.maximum(gain, gain.T)
    np.fill_diagonal(sym, NEG)
    partner = np.argmax(sym, axis=1)
    value = sym[np.arange(g), partner]
    used = np.zeros(g, dtype=bool)
    out = []
    for a in np.lexsort((np.arange(g), -value)):
        b = int(partner[a])
        if value[a] <= 0:
            break
        if not (used[a] or used[b]):
            used[a] = used[b] = True
            out.append((min(int(a), b), max(int(a), b)))
    return out


def fastest_link_pass(st: State) -> int:
    n = st.m.n
    order = st.mem[st.valid]  # peers grouped by label
    starts = np.concatenate([[0], np.cumsum(st.counts)[:-1]])
    position = np.empty(n, dtype=np.int64)
    position[order] = np.arange(n)
    fast = None
    for size in {st.lo, st.hi}:
        # fast[i, g]: i's cheapest link into g other than to itself. The matrix is symmetric, so
        # its rows, gathered by group, serve as columns; by blocks of columns to keep the
        # temporaries small at large N, reduced along axis 0 (contiguous rows).
        links, f = st.m.links(size), np.empty((n, st.m.n_groups), dtype=np.int64)
        for start in range(0, n, ROW_BLOCK):
            cols = np.arange(start, min(start + ROW_BLOCK, n))
            part = links[order, start : cols[-1] + 1]
            part[position[cols], cols - start] = BIG
            f[cols] = np.minimum.reduceat(part, starts, axis=0).T
        fast = f if fast is None else np.where(st.counts[None, :] == size, f, fast)
    own_fast = fast[np.arange(n), st.labels]
    best, arg = _best_pairs(st, own_fast[:, None] - fast)
    done = 0
    for a, b in _disjoint(best + best.T):
        u, v = int(arg[a, b]), int(arg[b, a])
        ma, mb = st.mem[a][st.valid[a]], st.mem[b][st.valid[b]]
        # exact: after the swap u's fastest link into b excludes v, and v's into a excludes u
        after = st.m.links(int(st.counts[b]))[u, mb[mb != v]].min(initial=BIG)
        after += st.m.links(int(st.counts[a]))[v, ma[ma != u]].min(initial=BIG)
        if own_fast[u] + own_fast[v] - after > 0:
            st.swap(u, v)
            done += 1
    if done:
        st.refresh()
    return done


def _prefix(block: np.ndarray) -> np.ndarray:
    """Sums of the top-left r x r sub-blocks, for every r: (Q, k, k) -> (Q, k)."""
    return np.diagonal(block.cumsum(axis=1).cumsum(axis=2), axis1=1, axis2=2)


def summed_link_pass(st: State, partners: int = 3, max_set: int = 8) -> int:
    """Kernighan-Lin on summed intra-group link costs, swapping sets (our addition).

    One swap cannot untangle AABB + AACC into AAAA + BBCC; a set swap can. For a group pair (a, b),
    members of a are ranked by what they would gain in b, members of b by what they would gain in
    a, and the first k of each are exchanged for the k with the largest exact gain:

        gain(k) = sum_U (S[u,a] - S[u,b]) + sum_V (S[v,b] - S[v,a]) + L_a(U,V) + L_b(U,V)
                  - (W_a(U) + W_a(V) + W_b(U) + W_b(V)) / 2

    with W the ordered sums inside a set, from prefix sums of the link blocks. Each group tries its
    `partners` most promising partners; the best positive set swaps on disjoint pairs are applied.
    Sets hold at most `max_set` peers, which bounds the blocks; larger moves take several passes.
    """
    g = st.m.n_groups
    score = st.own()[:, None] - st.sums.T
    best, _ = _best_pairs(st, score)
    estimate = best + best.T
    np.fill_diagonal(estimate, NEG)
    cand = np.argsort(-estimate, axis=1, kind="stable")[:, :partners]
    rows = np.repeat(np.arange(g), cand.shape[1])
    code = np.unique(np.minimum(rows, cand.ravel()) * g + np.maximum(rows, cand.ravel()))
    a, b = code // g, code % g
    a, b = a[a != b], b[a != b]
    if a.size == 0:
        return 0
    pairs = np.stack([a, b], axis=1)
    su = np.where(st.valid[a], score[st.mem[a], b[:, None]], NEG)  # (Q, s_max)
    sv = np.where(st.valid[b], score[st.mem[b], a[:, None]], NEG)
    ou, ov = np.argsort(-su, axis=1, kind="stable"), np.argsort(-sv, axis=1, kind="stable")
    ou, ov = ou[:, :max_set], ov[:, :max_set]
    us, vs = np.take_along_axis(st.mem[a], ou, 1), np.take_along_axis(st.mem[b], ov, 1)
    k = us.shape[1]
    idx = np.concatenate([us, vs], axis=1)
    both = st.links(idx[:, :, None], idx[:, None, :], a[:, None, None], also=b[:, None, None])
    linear = np.cumsum(np.take_along_axis(su, ou, 1) + np.take_along_axis(sv, ov, 1), axis=1)
    inner = (_prefix(both[:, :k, :k]) + _prefix(both[:, k:, k:])) // 2
    gain = linear + _prefix(both[:, :k, k:]) - inner
    gain = np.where(np.arange(k) < np.minimum(st.counts[a], st.counts[b])[:, None], gain, NEG)
    best_k = np.argmax(gain, axis=1)
    best_gain = gain[np.arange(len(pairs)), best_k]
    matrix = np.full((g, g), NEG, dtype=np.int64)
    matrix[a, b] = best_gain
    row = np.zeros((g, g), dtype=np.int64)
    row[a, b] = np.arange(len(pairs))
    moved = 0
    for x, y in _disjoint(matrix):
        q = row[x, y]
        for u, v in zip(us[q, : best_k[q] + 1], vs[q, : best_k[q] + 1], strict=True):
            st.swap(int(u), int(v))
        moved += int(best_k[q]) + 1
    if moved:
        st.refresh()
    return moved


def bottleneck_descent(st: State, steps: int, candidates: int) -> int:
    """Exact steepest descent on (round time, summed group cost): swaps of one of the slowest
    group's `candidates` worst-connected members (plus the starved path's slowest members when
    throughputs differ) with any other peer, and moves of them to a smaller group."""
    m, g = st.m, st.m.n_groups
    varies = m.balance_varies
    done = 0
    for _ in range(steps):
        own, gc = st.own(), st.gcost()
        cur = st.objective(gc)
        top = np.argsort(-gc, kind="stable")[:3]
        slow = st.mem[top[0]][st.valid[top[0]]]
        outgoing = list(slow[np.argsort(-own[slow], kind="stable")][:candidates])
        if varies:
            ms = st.mem[int(np.argmin(st.group_tps))][st.valid[int(np.argmin(st.group_tps))]]
            outgoing += [
                u for u in ms[np.argsort(m.tps[ms], kind="stable")][:candidates] if u not in outgoing
            ]
        grp = np.arange(g)[:, None, None]
        intra = st.links(st.mem[:, :, None], st.mem[:, None, :], grp)  # (G, s, s)
        pad = ~(st.valid[:, :, None] & st.valid[:, None, :]) | np.eye(st.mem.shape[1], dtype=bool)[None]
        best = None
        for u in outgoing:
            for score, op in _swap_scores(st, int(u), own, gc, top, intra, pad, varies) + _move_scores(
                st, int(u), own, gc, top, varies
            ):
                if score < cur and (best is None or score < best[0]):
                    best = (score, op)
        if best is None:
            break
        kind, u, x = best[1]
        if kind == "swap":
            st.swap(u, x)
            st.refresh()
        else:
            st.move(u, x)
        done += 1
    return done


def _others_max(gc: np.ndarray, top: np.ndarray, a: int, b: np.ndarray) -> np.ndarray:
    """Slowest group cost among groups other than a and b (b may be an array)."""
    out = np.zeros(np.shape(b), dtype=np.int64)
    for t in top[::-1]:
        out = np.where((t != a) & (t != b), gc[t], out)
    return out


def _swap_scores(st: State, u: int, own, gc, top, intra, pad, varies) -> list:
    m, g = st.m, st.m.n_groups
    a = int(st.labels[u])
    la = m.links(int(st.counts[a]))
    rest = st.mem[a][st.valid[a] & (st.mem[a] != u)]
    vs = np.flatnonzero(st.labels != a)
    new_a = np.maximum(
        ((own[rest] - la[rest, u])[:, None] + la[np.ix_(rest, vs)]).max(axis=0, initial=NEG),
        st.sums[a, vs] - la[u, vs],
    )
    # every group b at once: b loses v (one of its members) and gains u
    to_u = st.links(st.mem, u, np.arange(g)[:, None])  # (G, s)
    y = np.where(pad, NEG, (own[st.mem] + to_u)[:, :, None] - intra).max(axis=1)
    nb = np.maximum(y, st.sums[:, u][:, None] - to_u)
    new_b_all = np.empty(m.n, dtype=np.int64)
    new_b_all[st.mem[st.valid]] = nb[st.valid]
    new_b, vb = new_b_all[vs], st.labels[vs]
    comm = np.maximum(np.maximum(new_a, new_b), _others_max(gc, top, a, vb))
    total = gc.sum() - gc[a] - gc[vb] + new_a + new_b
    if varies:
        tps = np.broadcast_to(st.group_tps, (vs.size, g)).copy()
        delta = m.tps[vs] - m.tps[u]
        tps[:, a] += delta
        tps[np.arange(vs.size), vb] -= delta
        pen = m.balance_ns(tps)
    else:
        pen = int(m.balance_ns(st.group_tps))
    rnd = m.compute_ns + comm + pen
    k = int(np.lexsort((vs, total, rnd))[0])
    return [((int(rnd[k]), int(total[k])), ("swap", u, int(vs[k])))]


def _move_scores(st: State, u: int, own, gc, top, varies) -> list:
    """u leaves a full-size group for any one-smaller group: sizes stay balanced."""
    m = st.m
    a = int(st.labels[u])
    if st.lo == st.hi or st.counts[a] != st.hi:
        return []
    small = np.flatnonzero(st.counts == st.lo)
    rest = st.mem[a][st.valid[a] & (st.mem[a] != u)]
    llo, lhi = m.links(st.lo), m.links(st.hi)
    shared = m.shared_ns
    new_a = int((llo[np.ix_(rest, rest)].sum(axis=1) + shared[rest]).max(initial=0))
    sm, sv = st.mem[small], st.valid[small]
    rows = np.where(
        sv,
        lhi[sm[:, :, None], sm[:, None, :]].sum(axis=2, where=sv[:, None, :]) + lhi[sm, u] + shared[sm],
        NEG,
    )
    new_b = np.maximum(rows.max(axis=1), np.where(sv, lhi[u, sm], 0).sum(axis=1) + shared[u])
    comm = np.maximum(np.maximum(new_a, new_b), _others_max(gc, top, a, small))
    total = gc.sum() - gc[a] - gc[small] + new_a + new_b
    if varies:
        tps = np.broadcast_to(st.group_tps, (small.size, m.n_groups)).copy()
        tps[:, a] -= m.tps[u]
        tps[np.arange(small.size), small] += m.tps[u]
        pen = m.balance_ns(tps)
    else:
        pen = int(m.balance_ns(st.group_tps))
    rnd = m.compute_ns + comm + pen
    k = int(np.lexsort((small, total, rnd))[0])
    return [((int(rnd[k]), int(total[k])), ("move", u, int(small[k])))]
