"""``tether plan``: a discrete-event simulator of tether's fleet, calibrated on real runs.

:mod:`~tether.commands.plan.fleet` (what is simulated), :mod:`~tether.commands.plan.sim` (the SimPy model
of the protocol), :mod:`~tether.commands.plan.calibrate` (a finished run's rates in, its figures predicted),
:mod:`~tether.commands.plan.rates` (a rates file and a GPU split in), :mod:`~tether.commands.plan.weights`
(one weight update's cost: today's push, or a fleet pulling deltas from peers),
:mod:`~tether.commands.plan.project` (projections, best split, sweep), :mod:`~tether.commands.plan.runs`
(several runs sharing one rollout fleet, admitted by :mod:`~tether.commands.plan.gate`'s fair shares) and
:mod:`~tether.commands.plan.cli` (the subcommand). docs/PLANNER.md says how to read its output.
"""
