"""``tether plan``: a discrete-event simulator of tether's fleet, calibrated on real runs.

:mod:`~tether.plan.fleet` (what is simulated), :mod:`~tether.plan.sim` (the SimPy model of the protocol),
:mod:`~tether.plan.calibrate` (a finished run's rates in, its figures predicted), :mod:`~tether.plan.rates`
(a rates file and a GPU split in), :mod:`~tether.plan.weights` (one weight update's cost: today's push, or a
fleet pulling deltas from peers), :mod:`~tether.plan.project` (projections, best split, sweep) and
:mod:`~tether.plan.cli` (the subcommand). docs/PLANNER.md says how to read its output.
"""
