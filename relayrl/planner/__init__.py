"""``relayrl plan``: a placement planner whose predictions are checked against measured runs (HybridFlow §6's
auto-mapping, AsyncFlow's resource planner).

* :mod:`.profile`: what a device costs for each kind of work (calibrated or written by hand);
* :mod:`.calibrate`: ``relayrl plan --profile``, the measurements with relayrl's own engines;
* :mod:`.workload`: one step's work, with sampled response lengths and reward latencies;
* :mod:`.placement`: a placement (pools, step mode) and the prediction for it;
* :mod:`.simulate`: the discrete-event model of a step for a placement and step mode (its time);
* :mod:`.memory`: the peak memory per device of a placement;
* :mod:`.search`: candidate placements, the ranking by predicted TPSPD, the printed plan;
* :mod:`.cli`: the command.
"""
