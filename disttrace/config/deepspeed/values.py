"""Reading the DeepSpeed JSON (a duplicate key refused), its values checked one by one, and what each
top-level key without a manifest field is: ignored (changes nothing computed) or unsupported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from disttrace.config.freezing import read_text_file
from disttrace.errors import BadInput


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    # DeepSpeed loads configs with dict_raise_error_on_duplicate_keys: a repeated key is an error, not "last wins"
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


class _Duplicate(Exception):
    pass


def read_ds_config(path: Path) -> dict:
    path = Path(path)
    text = read_text_file(path, "DeepSpeed config")
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise BadInput(
            path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except _Duplicate as e:
        raise BadInput(
            path, "duplicate key (DeepSpeed refuses repeated keys)", field=str(e.args[0])
        ) from None
    except RecursionError:
        raise BadInput(path, "not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal longer than Python's int-conversion limit
        raise BadInput(path, f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise BadInput(path, f"a DeepSpeed config is a JSON object, not {_json_type(cfg)}")
    return cfg


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


# Top-level keys with no manifest field. "ignored": changes nothing that is computed (logging, profiling,
# memory/communication tuning, DeepSpeed's own checkpoint files); "unsupported": would change the computation
# under DeepSpeed, but the manifest cannot express it, so the frozen manifest runs without it.
_TOP_LEVEL: dict[str, tuple[str, str]] = {
    "steps_per_print": ("ignored", "logging only"),
    "wall_clock_breakdown": ("ignored", "timing/logging only"),
    "memory_breakdown": ("ignored", "logging only"),
    "dump_state": ("ignored", "logging only"),
    "tensorboard": ("ignored", "monitoring only"),
    "wandb": ("ignored", "monitoring only"),
    "csv_monitor": ("ignored", "monitoring only"),
    "comet": ("ignored", "monitoring only"),
    "comms_logger": ("ignored", "logging only"),
    "flops_profiler": ("ignored", "profiling only"),
    "autotuning": ("ignored", "DeepSpeed's autotuner, not part of a run"),
    "timers": ("ignored", "timing only"),
    "checkpoint": (
        "ignored",
        "DeepSpeed's checkpoint-file options; disttrace writes its own DCP checkpoints "
        "(checkpoint.interval)",
    ),
    "nebula": ("ignored", "DeepSpeed's checkpoint service"),
    "aio": ("ignored", "NVMe swap I/O tuning"),
    "activation_checkpointing": (
        "ignored",
        "recomputation trades memory for time; the values are the same",
    ),
    "zero_allow_untested_optimizer": ("ignored", "a DeepSpeed safety switch"),
    "zero_force_ds_cpu_optimizer": ("ignored", "a DeepSpeed safety switch"),
    "dataloader_drop_last": ("ignored", "disttrace builds its own data loader"),
    "disable_allgather": ("ignored", "communication tuning"),
    "scheduler": (
        "unsupported",
        "the manifest has no learning-rate schedule (training.lr is constant); not applied",
    ),
    "pipeline": (
        "unsupported",
        "DeepSpeed's pipeline engine options; not applied (parallelism.pp)",
    ),
    "sparse_attention": (
        "unsupported",
        "the manifest's model has dense attention only; not applied",
    ),
    "sparse_gradients": ("unsupported", "not applied"),
    "compression_training": ("unsupported", "not applied"),
    "quantize_training": ("unsupported", "not applied"),
    "data_efficiency": ("unsupported", "data sampling/routing is not applied"),
    "curriculum_learning": ("unsupported", "not applied"),
    "progressive_layer_drop": ("unsupported", "not applied"),
    "data_types": ("unsupported", "not applied; gradients accumulate in training.dtype"),
    "communication_data_type": ("unsupported", "collectives run in training.dtype; not applied"),
    "seq_parallel_communication_data_type": ("unsupported", "not applied"),
    "prescale_gradients": (
        "unsupported",
        "not applied; gradients are averaged after the all-reduce",
    ),
    "gradient_predivide_factor": ("unsupported", "not applied"),
    "fp32_allreduce": ("ignored", "collectives already run in training.dtype (float32/float64)"),
    "hybrid_engine": ("unsupported", "not applied"),
    "tensor_parallel": ("unsupported", "DeepSpeed AutoTP options; not applied (parallelism.tp)"),
    "sequence_parallel_size": ("unsupported", "not applied"),
    "weight_quantization": ("unsupported", "not applied"),
    "vocabulary_size": (
        "ignored",
        "a DeepSpeed alignment hint; model.vocab_size comes from the base manifest",
    ),
}


# Values of those keys that are DeepSpeed's defaults, i.e. say "off": listed as ignored, not unsupported.
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "sparse_gradients": (False,),
    "prescale_gradients": (False,),
    "gradient_predivide_factor": (1, 1.0),
    "communication_data_type": (None, "fp32"),
    "seq_parallel_communication_data_type": (None, "fp32"),
    "data_types": ({},),
}


def _num(cfg_path: Path, key: str, v: Any, integer: bool = False) -> Any:
    if v == "auto":
        raise BadInput(
            cfg_path,
            "'auto' is filled in by the Hugging Face Trainer integration, not by DeepSpeed; "
            "state the value",
            field=key,
        )
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadInput(
            cfg_path, f"must be {'an integer' if integer else 'a number'} (got {v!r})", field=key
        )
    return v


def _section(cfg_path: Path, key: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise BadInput(cfg_path, f"must be a JSON object (got {_json_type(v)})", field=key)
    return v


def _enabled(cfg_path: Path, key: str, sec: dict) -> bool:
    v = sec.get("enabled", False)
    if v is None:
        return False
    if v == "auto":
        return True  # 'auto' lets the Trainer turn it on; refuse it like true
    if not isinstance(v, bool):
        raise BadInput(cfg_path, f"must be true or false (got {v!r})", field=f"{key}.enabled")
    return v


def _set(doc: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    sec = doc.setdefault(section, {})
    if not isinstance(
        sec, dict
    ):  # the base was validated, so this cannot happen; never a traceback anyway
        raise BadInput(dotted, "is not a table", field=section)
    sec[key] = value
