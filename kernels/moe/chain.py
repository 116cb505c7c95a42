"""Where a kernel of the MoE call sits in a chain of programmatic dependent launches (Hopper's PDL).

The call's kernels run one after the other on one stream, each reading what the one before wrote.
Launched plainly, each waits for the previous grid to drain and then pays its own launch and ramp
(~1 us per boundary; DSA v1.2 measured the same gap and removed it this way). In a chain:

- a kernel that `releases` lets the next grid launch as soon as all of its own CTAs have started
  (`griddepcontrol.launch_dependents`, first thing in the kernel);
- a kernel that `waits` is launched as a programmatic dependent and, before it reads anything,
  waits (`griddepcontrol.wait`) until the previous grid has completed and its writes are visible.

Correctness does not depend on where the trigger is: the wait covers the whole previous grid, which
itself completed only after its own wait, so every earlier kernel of the chain is complete too. The
next grid launches only once every CTA of the releasing grid has started, so its waiting CTAs never
keep one of those off an SM. The first kernel of a call must not wait (the previous call's last
kernel may still be reading the workspaces of that call) and the last must not release.

Candidate v2.9 (row-tile hand-over, NOTES.md) adds two options: a kernel that `releases_after_wait`
lets the next grid launch only once all of its CTAs have passed their own wait (so the next grid
launches after every kernel before this one has completed), and a kernel that `polls` is launched as a
programmatic dependent but does not wait for the previous grid: it synchronises on per-row-tile
counters that the previous kernel releases as it finishes each tile, and may read only what the
kernels before the previous one wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute

__all__ = ["ChainLink", "Linked", "NO_CHAIN", "chain_links", "enter"]


@dataclass(frozen=True)
class ChainLink:
    waits: bool = False  # launched as a programmatic dependent of the previous kernel
    releases: bool = False  # lets the next kernel launch once all of this grid's CTAs have started
    releases_after_wait: bool = False  # ... once all of them have passed their wait (v2.9)
    polls: bool = False  # launched as a dependent, synchronising on row-tile counters, not the grid (v2.9)


NO_CHAIN = ChainLink()


class Linked:
    """A kernel class that takes its place in a chain (`link`; NO_CHAIN: launched plainly)."""

    def __init__(self, link: ChainLink = NO_CHAIN):
        self.link = link


def chain_links(num_kernels: int) -> tuple[ChainLink, ...]:
    """The links of `num_kernels` kernels launched in order: the first releases, the middle ones
    wait and release, the last waits."""
    return tuple(ChainLink(waits=i > 0, releases=i < num_kernels - 1) for i in range(num_kernels))


def enter(link: ChainLink) -> None:
    """The kernel's first statements for its place in the chain; nothing for NO_CHAIN. Called
    while a kernel is traced (`link` is a compile-time value)."""
    if link.releases and not link.releases_after_wait:
        cute.arch.griddepcontrol_launch_dependents()
    if link.waits and not link.polls:
        cute.arch.griddepcontrol_wait()
    if link.polls:
        # The kernels before the previous one completed before this grid launched (that one releases
        # after its wait); an acquire fence orders this kernel's reads of their outputs after that.
        cute.arch.fence_acq_rel_gpu()
    if link.releases and link.releases_after_wait:
        cute.arch.griddepcontrol_launch_dependents()
