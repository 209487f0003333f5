"""What a lab notebook uses, in one place: `from dtlab.lab import lab_config, check, bucket_timeline`.

A lab imports `dtlab` (the public API: RunConfig, run, calibrate, predict, load_run, ...) and this module, nothing
else of dtlab: so a notebook is a reader's entry, not a map of dtlab's internals. Every name here is defined, and
documented, in the module `WHERE` names; this module only finds it there, on first use (a lab that draws no
pipeline never imports the pipeline figures), as `dtlab` itself does. A name is a function, class or constant,
or, where a lab reads several functions of one idea, that module (`costmodel`, `wording`, `planner_model`,
`labNN_claims`: the claims one lab prints from its own runs).
"""

import importlib

#: name -> (module, attribute); attribute None: the name is the module itself
WHERE = {
    # ---- running a lab
    "EmulationUnavailable": ("dtlab.launching.emulate", "EmulationUnavailable"),
    "attempt": ("dtlab.course.labs", "attempt"),
    "doctor": ("dtlab.cli.doctor", "doctor"),
    "lab_config": ("dtlab.course.labs", "lab_config"),
    "lr_at": ("dtlab.config.convergence", "lr_at"),
    "machine_banner": ("dtlab.course.labs", "machine_banner"),
    "model_arch": ("dtlab.config.models", "model_arch"),
    "parse_rate": ("dtlab.launching.emulate", "parse_rate"),
    "quick_mode": ("dtlab.course.labs", "quick_mode"),
    "shaping_unavailable": ("dtlab.launching.emulate", "shaping_unavailable"),
    "smoke_allreduce": ("dtlab.cli.doctor", "smoke_allreduce"),
    "update_batch": ("dtlab.config.convergence", "update_batch"),
    # ---- checks and claims
    "answered": ("dtlab.course.checks", "answered"),
    "beside": ("dtlab.course.beside", "beside"),
    "beside_calibration": ("dtlab.course.beside", "beside_calibration"),
    "beside_nccl_tests": ("dtlab.course.beside", "beside_nccl_tests"),
    "check": ("dtlab.course.checks", "check"),
    "check_comm_hook": ("dtlab.course.exercises", "check_comm_hook"),
    "check_exercise": ("dtlab.course.checks", "check_exercise"),
    "check_ring_allreduce": ("dtlab.course.exercises", "check_ring_allreduce"),
    "fit_note": ("dtlab.course.claims", "fit_note"),
    "interleaved": ("dtlab.course.claims.runs", "interleaved"),
    "kind": ("dtlab.course.wording", "kind"),
    "lab00_claims": ("dtlab.course.claims.lab00", None),
    "lab01_claims": ("dtlab.course.claims.lab01", None),
    "lab03_claims": ("dtlab.course.claims.lab03", None),
    "lab05_claims": ("dtlab.course.claims.lab05", None),
    "lab06_claims": ("dtlab.course.claims.lab06", None),
    "lab07_claims": ("dtlab.course.claims.lab07", None),
    "lab08_claims": ("dtlab.course.claims.lab08", None),
    "lab09_claims": ("dtlab.course.claims.lab09", None),
    "lab10_claims": ("dtlab.course.claims.lab10", None),
    "lab12_claims": ("dtlab.course.claims.lab12", None),
    "nccl_beside": ("dtlab.course.wording", "nccl_beside"),
    "order_text": ("dtlab.course.claims.runs", "order_text"),
    "ring_timings": ("dtlab.course.exercises", "ring_timings"),
    "runs_table": ("dtlab.course.claims.runs", "runs_table"),
    "spread": ("dtlab.course.claims", "spread"),
    "step_wait": ("dtlab.course.claims.runs", "step_wait"),
    "timed_medians": ("dtlab.course.claims.runs", "timed_medians"),
    "wording": ("dtlab.course.wording", None),
    # ---- models and formulas
    "checkpoint_tradeoff": ("dtlab.model.restarts", "checkpoint_tradeoff"),
    "comm_per_sample": ("dtlab.model.compression", "comm_per_sample"),
    "compression_from_run": ("dtlab.model.compression", "compression_from_run"),
    "compute_from_run": ("dtlab.model.whatif", "compute_from_run"),
    "costmodel": ("dtlab.model.costmodel", None),
    "first_to_target": ("dtlab.model.convergence", "first_to_target"),
    "forms_table": ("dtlab.model.ps", "forms_table"),
    "hierarchy": ("dtlab.model.hierarchy", None),
    "lever_from_run": ("dtlab.model.convergence", "lever_from_run"),
    "lever_table": ("dtlab.model.compression", "lever_table"),
    "loss_beside": ("dtlab.model.compression", "loss_beside"),
    "measured_costs": ("dtlab.model.restarts", "measured_costs"),
    "model_param_nbytes": ("dtlab.model.whatif", "model_param_nbytes"),
    "model_param_shapes": ("dtlab.model.whatif", "model_param_shapes"),
    "planner_model": ("dtlab.model.planner", None),
    "powersgd_wire_numel": ("dtlab.model.compression", "powersgd_wire_numel"),
    "profile_table": ("dtlab.model.profile", "profile_table"),
    "ring_allreduce": ("dtlab.model.costmodel", "ring_allreduce"),
    "time_to_target": ("dtlab.model.convergence", "time_to_target"),
    "whatif_table": ("dtlab.results.whatif", "whatif_table"),
    # ---- reading runs
    "blocked_table": ("dtlab.results.waits", "blocked_table"),
    "breakdown_text": ("dtlab.results.kineto.text", "breakdown_text"),
    "bubble_table": ("dtlab.results.pipeline", "bubble_table"),
    "in_flight": ("dtlab.results.pipeline", "in_flight"),
    "overlap_text": ("dtlab.results.kineto.text", "overlap_text"),
    "per_layer": ("dtlab.results.parallel", "per_layer"),
    "restart_lines": ("dtlab.results.restarts", "restart_lines"),
    "samples_frame": ("dtlab.results.calibration", "samples_frame"),
    "staleness_histogram": ("dtlab.results.convergence", "staleness_histogram"),
    "table_text": ("dtlab.results.kineto.text", "table_text"),
    "tp_collectives": ("dtlab.results.parallel", "tp_collectives"),
    "wait_summary": ("dtlab.results.stragglers", "wait_summary"),
    # ---- figures and widgets
    "breakdown_bar": ("dtlab.viz.figures", "breakdown_bar"),
    "bubble_figure": ("dtlab.viz.parallel", "bubble_figure"),
    "bucket_timeline": ("dtlab.viz.figures", "bucket_timeline"),
    "bytes_by_op": ("dtlab.viz.figures", "bytes_by_op"),
    "calibration_figure": ("dtlab.viz.calibration", "calibration_figure"),
    "nccl_tests_figure": ("dtlab.viz.nccl_tests", "nccl_tests_figure"),
    "convergence_explorer": ("dtlab.viz.convergence", "convergence_explorer"),
    "convergence_figure": ("dtlab.viz.convergence", "convergence_figure"),
    "explorer": ("dtlab.viz.dashboard", "explorer"),
    "forms_figure": ("dtlab.viz.calibration", "forms_figure"),
    "levels_table": ("dtlab.viz.two_level", "levels_table"),
    "lever_bytes_table": ("dtlab.viz.compression", "lever_bytes_table"),
    "loss_beside_figure": ("dtlab.viz.compression", "loss_beside_figure"),
    "memory_bars": ("dtlab.viz.figures", "memory_bars"),
    "per_sample_figure": ("dtlab.viz.compression", "per_sample_figure"),
    "pipeline_timeline": ("dtlab.viz.parallel", "pipeline_timeline"),
    "planner": ("dtlab.viz.planner", "planner"),
    "planner_table": ("dtlab.viz.planner", "planner_table"),
    "predicted_breakdown_figure": ("dtlab.viz.model_plots", "predicted_breakdown_figure"),
    "ps_shapes_figure": ("dtlab.viz.ps", "ps_shapes_figure"),
    "tp_timeline": ("dtlab.viz.parallel", "tp_timeline"),
    "trace_timeline": ("dtlab.viz.trace_report", "trace_timeline"),
    "two_level_explorer": ("dtlab.viz.two_level", "two_level_explorer"),
    "two_level_figure": ("dtlab.viz.two_level", "two_level_figure"),
    "who_waited": ("dtlab.viz.stragglers", "who_waited"),
    "wire_bytes_figure": ("dtlab.viz.compression", "wire_bytes_figure"),
    # ---- units and tables
    "fmt_bytes_exact": ("dtlab.units", "fmt_bytes_exact"),
    "fmt_time": ("dtlab.units", "fmt_time"),
    "sig_table": ("dtlab.units", "sig_table"),
}

__all__ = sorted(WHERE)


def __getattr__(name):
    if name in WHERE:
        module, attr = WHERE[name]
        value = importlib.import_module(module)
        value = value if attr is None else getattr(value, attr)
        if module.startswith("dtlab.viz."):  # a lab that draws: its figures' .show() draws in an export too
            importlib.import_module("dtlab.viz.livefigure").use_course_renderer()
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dtlab.lab' has no attribute {name!r} (a lab's names: dtlab.lab.__all__)")


def __dir__():
    return sorted(list(globals()) + __all__)
