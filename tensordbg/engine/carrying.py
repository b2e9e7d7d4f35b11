"""Which activation gradients reach which whole, through the autograd nodes that carry a
gradient on (an addition, a reshape, an activation's derivative, attention without dropout):
what lets one parameter's gradient vouch for gradients far from its module
(:mod:`.vouching`), and, on a pass that showed a problem, whether a vouched tensor's gradient
came from one gradient alone (then a NaN in it was in that one too)."""

from __future__ import annotations

from typing import Any

# Autograd nodes that hand every element of the gradient they get to the gradient of each of
# their inputs, added, multiplied (by anything: NaN * 0 is NaN), summed over a broadcast or
# moved, never dropped or masked (ReLU's backward and clamp's drop; they are not here).
# tests/test_vouching.py makes each with torch and checks it.
CARRY_NODES = frozenset({
    "AddBackward0", "SubBackward0", "RsubBackward0", "RsubBackward1", "MulBackward0",
    "DivBackward0", "NegBackward0", "CloneBackward0", "ToCopyBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "TransposeBackward0", "TransposeBackward1", "PermuteBackward0",
    "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
    "SqueezeBackward2", "SelectBackward0", "SliceBackward0", "GeluBackward0", "SiluBackward0",
    "TanhBackward0", "SigmoidBackward0", "SoftplusBackward0", "EluBackward0",
    "LeakyReluBackward0", "MishBackward0", "NativeDropoutBackward0", "UnbindBackward0",
    "SplitBackward0", "SplitWithSizesBackward0",
})  # fmt: skip
# Attention without dropout: a NaN or Inf in row i of the output's gradient reaches the whole
# row i of the query's gradient and, through the softmax's backward (the row's sum of gradient
# times output), of the key's and the value's at the positions row i attends to (itself among
# them, when causal). With dropout an element's factor may be dropped: not carried.
ATTENTION_NODES = frozenset({"ScaledDotProductFlashAttentionForCpuBackward0"})
CARRY_DEPTH = 6  # how many such nodes a gradient is followed through


def carried_to(node: Any, vouched: dict[tuple[int, int], Any], depth: int) -> Any:
    """The vouched tensor the gradient of ``node``'s output reaches whole through autograd
    nodes that carry every element on (``CARRY_NODES``), if any: the nearest one (fewest nodes
    between, breadth first), whose gradient is the most nearly this one alone. A residual
    stream's gradient is vouched for by the block's last bias, which sums exactly it, not by
    the embedding far down the stream, which sums it with every block's."""
    level = [node]
    for _ in range(depth):
        below = []
        for n in level:
            if n is None or not carries(n):
                continue
            for fn, nr in n.next_functions:
                if fn is None:
                    continue
                found = vouched.get((id(fn), nr))
                if found is not None:
                    return found
                below.append(fn)
        if not below:
            return None
        level = below
    return None


def carries(node: Any) -> bool:
    name = type(node).__name__
    return name in CARRY_NODES or (name in ATTENTION_NODES and not node._saved_dropout_p)


def consumers(roots: list[Any]) -> dict[Any, list[int]]:
    """The nodes of the autograd graph below ``roots`` that take each (node id, output
    number)'s gradient, and each node id's (whatever the output)."""
    consumers: dict[Any, list[int]] = {}
    seen: set[int] = set()
    stack = [n for n in roots if n is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for fn, nr in node.next_functions:
            if fn is not None:
                consumers.setdefault((id(fn), nr), []).append(id(node))
                consumers.setdefault(id(fn), []).append(id(node))
                stack.append(fn)
    return consumers


def reached(node: Any, targets: dict[tuple[int, int], bool], depth: int) -> set[tuple[int, int]]:
    """The vouched tensors (keys of ``targets``) that ``node``'s output gradient reaches
    through carrying nodes."""
    found: set[tuple[int, int]] = set()
    level, seen = [node], set()
    for _ in range(depth):
        below = []
        for n in level:
            for fn, nr in n.next_functions:
                if fn is None:
                    continue
                if (id(fn), nr) in targets:
                    found.add((id(fn), nr))
                elif carries(fn) and id(fn) not in seen:
                    seen.add(id(fn))
                    below.append(fn)
        level = below
    return found


def fed_by(node: Any, target: tuple[int, int], consumers: dict[Any, list[int]],
            depth: int) -> bool:  # fmt: skip
    """Whether the gradient of ``target`` is made from ``node``'s output gradient alone: every
    node on the ways from ``node`` to it (through carrying nodes), and ``target`` itself, takes
    gradients only from ``node`` or nodes on those ways. Then a NaN or Inf in ``target``'s
    gradient came through ``node``'s (the carrying nodes make none of their own)."""
    way: set[int] = set()
    memo: dict[int, bool] = {}

    def leads(n: Any, d: int) -> bool:
        if id(n) in memo:
            return memo[id(n)]
        memo[id(n)] = False
        found = False
        for fn, nr in n.next_functions:
            if fn is None:
                continue
            if (id(fn), nr) == target or (d > 1 and carries(fn) and leads(fn, d - 1)):
                found = True
        if found:
            way.add(id(n))
        memo[id(n)] = found
        return found

    if not leads(node, depth):
        return False
    inside = way | {id(node)}
    return all(c in inside for c in consumers.get(target, ())) and all(
        c in inside for n in way - {id(node)} for c in consumers.get(n, ())
    )
