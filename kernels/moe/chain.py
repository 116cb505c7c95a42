"""Where a kernel of the MoE call sits in a chain of programmatic dependent launches (Hopper's PDL).

The call's kernels run one after the other on one stream, each reading what the one before wrote.
Launched plainly, each waits for the previous grid to drain and then pays its own launch and ramp
(~1 us per boundary; the DSA kernel removes the same gap this way). In a chain:

- a kernel that `releases` lets the next grid launch as soon as all of its own CTAs have started
  (`griddepcontrol.launch_dependents`, first thing in the kernel);
- a kernel that `waits` is launched as a programmatic dependent and, before it reads anything,
  waits (`griddepcontrol.wait`) until the previous grid has completed and its writes are visible.

Correctness does not depend on where the trigger is: the wait covers the whole previous grid, which
itself completed only after its own wait, so every earlier kernel of the chain is complete too. The
next grid launches only once every CTA of the releasing grid has started, so its waiting CTAs never
keep one of those off an SM. The first kernel of a call must not wait (the previous call's last
kernel may still be reading the workspaces of that call) and the last must not release.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute

__all__ = ["ChainLink", "Linked", "NO_CHAIN", "chain_links", "enter"]


@dataclass(frozen=True)
class ChainLink:
    waits: bool = False  # launched as a programmatic dependent of the previous kernel
    releases: bool = False  # lets the next kernel launch once all of this grid's CTAs have started


NO_CHAIN = ChainLink()


class Linked:
    """A kernel class that takes its place in a chain (`link`; NO_CHAIN: launched plainly)."""

    def __init__(self, link: ChainLink = NO_CHAIN):
        self.link = link


def chain_links(num_kernels: int) -> tuple[ChainLink, ...]:
    """The links of `num_kernels` kernels launched in order: the first releases, the middle ones
    wait and release, the last waits."""
    return tuple(ChainLink(waits=i > 0, releases=i < num_kernels - 1) for i in range(num_kernels))


def enter(link: ChainLink, wait: bool = True) -> None:
    """The kernel's first statements for its place in the chain; nothing for NO_CHAIN. Called
    while a kernel is traced (`link` is a compile-time value). `wait=False`: the kernel calls
    `griddepcontrol_wait` itself before it reads anything the previous kernels write."""
    if link.releases:
        cute.arch.griddepcontrol_launch_dependents()
    if link.waits and wait:
        cute.arch.griddepcontrol_wait()
