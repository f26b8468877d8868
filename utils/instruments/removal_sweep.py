"""The layer-removal sweep through lm-eval: the baseline, then each decoder layer removed in turn (in memory) and
the model evaluated again; one row per (removed layer, task). Command line: layer_remove.py --sweep; the study's
analyses call heldout_removal_sweep.
"""
from __future__ import annotations

import contextlib
import tempfile
from unittest import mock

from tqdm.auto import tqdm

from peft_pretraining.data import lm_eval_tasks
from peft_pretraining.model.model_parts import decoder_layers
from utils.instruments.removal import check_layer_index, layer_removed

# HFLM warns this whenever it is handed a model object rather than a name; the sweep does so on purpose (one process,
# no accelerate, no parallelize), once per removed layer, so the warning says nothing about this use.
LM_EVAL_MODEL_OBJECT_WARNING = "`pretrained` model kwarg is not of type `str`"


class _DropMessage:
    """logging filter dropping the records whose message starts with `prefix`, and no others."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def filter(self, record) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def quiet_lm_eval_model_object_warning():
    import logging

    drop = _DropMessage(LM_EVAL_MODEL_OBJECT_WARNING)
    logger = logging.getLogger("lm_eval.models.huggingface")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def without_environment_report():
    """simple_evaluate ends by collecting the environment (torch's collect_env runs pip, nvidia-smi and more) and the
    git hash, for its results' metadata, which the sweep never reads: about a third of a study checkpoint's analysis
    on a CPU, once per evaluation. Every score, sample and direction it returns is unchanged."""
    with mock.patch("lm_eval.evaluator.add_env_info", lambda results: None), \
            mock.patch("lm_eval.evaluator.get_git_commit_hash", lambda: None):
        yield


def evaluate(model, tokenizer, tasks: list[str], manager, batch_size: int, limit, bootstrap_iters: int,
             max_length: int, per_document: bool = False) -> tuple[dict, dict]:
    """lm-eval on an in-memory model, never feeding it more than max_length positions (rolling-perplexity windows
    and truncated contexts are cut there). Returns {task: {metric: (value, higher_is_better)}} and, with
    per_document, {task: {metric name: [each document's value, in document order]}} (else {})."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    with quiet_lm_eval_model_object_warning():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                  max_length=max_length)
    with without_environment_report():
        output = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                 bootstrap_iters=bootstrap_iters, log_samples=per_document)
    documents = {}
    for task in tasks if per_document else ():
        if task not in output["samples"]:
            raise ValueError(f"--per_document: lm-eval logged no samples for {task!r} (a group of tasks?); "
                             "name its subtasks instead")
        documents[task] = document_values(output["samples"][task])
    scores = {}
    for task in tasks:
        metrics = output["results"].get(task)
        if metrics is None:
            raise ValueError(f"--tasks: lm-eval returned no result for {task!r}")
        # higher_is_better lists exactly the task's metrics (not sample_len, aliases or stderrs).
        directions = output["higher_is_better"].get(task, {})
        scores[task] = {key: (float(value), bool(directions[key.split(",")[0]])) for key, value in metrics.items()
                        if key.split(",")[0] in directions and isinstance(value, (int, float))}
        if not scores[task]:
            raise ValueError(f"--tasks: lm-eval reported no metric for {task!r}")
    return scores, documents


def document_values(samples: list[dict]) -> dict[str, list]:
    """Each metric's per-document values from lm-eval's logged samples, in document order. A perplexity metric's
    value is the pair lm-eval aggregates: [log-likelihood, words or bytes]; an accuracy is a number."""
    samples = sorted(samples, key=lambda sample: sample["doc_id"])
    names = samples[0]["metrics"] if samples else []
    return {name: [list(s[name]) if isinstance(s[name], (tuple, list)) else s[name] for s in samples]
            for name in names}


def check_metric_reported(tasks: list[str], manager, metric: str) -> None:
    """ValueError naming --metric unless every task (every subtask of a group) reports it; asked of the task
    definitions, before anything is evaluated."""
    from lm_eval.tasks import get_task_dict

    def leaf_tasks(node):
        if isinstance(node, dict):
            for value in node.values():
                yield from leaf_tasks(value)
        elif hasattr(node, "higher_is_better"):
            yield node

    reported = [set(task.higher_is_better()) for task in leaf_tasks(get_task_dict(tasks, manager))]
    common = set.intersection(*reported) if reported else set()
    if metric.split(",")[0] not in common:
        raise ValueError(f"--metric: {metric!r} is not reported by every task of {', '.join(tasks)} "
                         f"(available: {', '.join(sorted(common)) or 'none in common'})")


def pick_metric(scores: dict, task: str, metric: str | None) -> str:
    available = list(scores[task])
    if metric is None:
        return available[0]
    matches = [key for key in available if key == metric or key.split(",")[0] == metric]
    if not matches:
        raise ValueError(f"--metric: {metric!r} not reported by task {task!r} (available: {', '.join(available)})")
    return matches[0]


def sweep(model, tokenizer, tasks: list[str], manager, max_length: int, metric: str | None = None,
          batch_size: int = 8, limit=None, bootstrap_iters: int = 0,
          layer_indices: list[int] | None = None, per_document: bool = False, on_rows=None,
          done: dict | None = None) -> list[dict]:
    """Baseline plus one evaluation per removed layer; one row per (removed layer, task).

    ``drop`` is the performance lost by removing the layer (positive = worse), whatever the metric's direction:
    baseline - value when higher is better (accuracy), value - baseline when lower is better (perplexity).
    With ``per_document`` each row also holds ``documents``: the metric's value on each document (see
    document_values), for intervals over documents. ``on_rows(rows, higher_is_better)`` is called with the rows so
    far after each evaluation (run_sweep writes them to disk, so that a killed sweep keeps what it measured);
    ``done`` ({"rows", "higher_is_better"} from that file) resumes: its baseline is reused and its layers skipped.
    """
    num_layers = len(decoder_layers(model))
    layer_indices = list(range(num_layers)) if layer_indices is None else layer_indices
    for index in layer_indices:
        check_layer_index(index, num_layers)

    def row(removed_layer, task, key, value, drop, relative_drop, documents):
        found = dict(removed_layer=removed_layer, task=task, metric=key, value=value, drop=drop,
                     relative_drop=relative_drop)
        if per_document:
            found["documents"] = documents[task][key.split(",")[0]]
        return found

    if done is None:
        baseline, baseline_documents = evaluate(model, tokenizer, tasks, manager, batch_size, limit,
                                                bootstrap_iters, max_length, per_document)
        metric_by_task = {task: pick_metric(baseline, task, metric) for task in tasks}
        rows = [row(None, task, metric_by_task[task], baseline[task][metric_by_task[task]][0], 0.0, 0.0,
                    baseline_documents) for task in tasks]
        directions = {task: baseline[task][metric_by_task[task]][1] for task in tasks}  # higher is better?
    else:
        rows, directions = list(done["rows"]), done["higher_is_better"]
        base_rows = {row["task"]: row for row in rows if row["removed_layer"] is None}
        metric_by_task = {task: base_rows[task]["metric"] for task in tasks}
        baseline = {task: {base_rows[task]["metric"]: (base_rows[task]["value"], directions[task])}
                    for task in tasks}
    if on_rows is not None:
        on_rows(rows, directions)
    measured = {row["removed_layer"] for row in rows}
    for index in tqdm([index for index in layer_indices if index not in measured], desc="removing layers",
                      unit="layer", dynamic_ncols=True):
        with layer_removed(model, index):
            scores, documents = evaluate(model, tokenizer, tasks, manager, batch_size, limit, bootstrap_iters,
                                         max_length, per_document)
        for task in tasks:
            key = metric_by_task[task]
            base_value, higher_is_better = baseline[task][key]
            value = scores[task][key][0]
            drop = base_value - value if higher_is_better else value - base_value
            rows.append(row(index, task, key, value, drop, drop / abs(base_value) if base_value else float("nan"),
                            documents))
        if on_rows is not None:
            on_rows(rows, directions)
    return rows


def heldout_removal_sweep(model, tokenizer, max_length: int, text_file: str | None, max_documents: int,
                          batch_size: int = 8) -> list[dict]:
    """The sweep on the held-out perplexity task (the first max_documents documents of text_file, default the
    embedded held-out novel) with each document's values: what layer_remove.py --sweep --tasks heldout_novel_ppl
    --task_text_file FILE --task_max_documents N --per_document computes."""
    task = lm_eval_tasks.HELDOUT_PERPLEXITY_TASK
    with tempfile.TemporaryDirectory(prefix="lm_eval_tasks_") as task_dir:
        include_paths = lm_eval_tasks.build_local_tasks(
            [task], task_dir, {task: {"text_file": text_file, "max_documents": max_documents}})
        manager = lm_eval_tasks.task_manager(include_paths, include_defaults=False)
        return sweep(model, tokenizer, [task], manager, max_length, batch_size=batch_size, per_document=True)
