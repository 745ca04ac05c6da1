"""Trace replay of autoscaling policies (`kvfleet bench autoscale`): a user's request trace, or a bundled workload,
run second by second through a simulated fleet under kvfleet's autoscaler and the usual alternatives, each scored
by TTFT SLO attainment per priority class against the replica-seconds it paid.

engine_model.py is one engine pod, fleet.py the gateway in front of the pods and the simulation loop, trace.py the
trace (CSV in and out), workloads.py the bundled traces, policies.py and kpa.py the reactive autoscalers,
oracle.py the planner that knows the trace in advance, slo.py the objectives and the score, replay.py the runs,
report.py the table and chart, cli.py the command. bench/autoscaler_sim/ drives the same model for the project's
own benchmark.
"""
