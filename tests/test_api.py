"""The public names of every package: adding or removing one is a deliberate change to this
list (and to the README where a user meets it)."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest

PUBLIC = {
    "bdh_train": [
        "BDH",
        "BDHConfig",
        "IGNORE_INDEX",
        "LanguageTrainModel",
        "ModelState",
        "RunConfig",
        "SequenceBatch",
        "StepOutput",
        "Trainer",
        "WeightedGradientAccumulator",
        "__version__",
        "load_config",
        "load_run",
        "score_text",
    ],
    "bdh_train.model": [
        "BDH",
        "BDHConfig",
        "LanguageHeadConfig",
        "ModelState",
        "QuantConfig",
        "sample_next_token",
    ],
    "bdh_train.data": [
        "BUILTIN_CORPORA",
        "ByteTokenizer",
        "DataConfig",
        "GENERATED_SOURCES",
        "MqarConfig",
        "NcaConfig",
        "RandomWindowLoader",
        "StreamingCorpusLoader",
        "StreamingDocumentLoader",
        "TOKEN_DTYPES",
        "TokenData",
        "TokenGenerator",
        "TokenSource",
        "builtin_corpus",
        "eval_batches",
        "header_path",
        "iter_documents",
        "load_prepared",
        "load_splits",
        "load_tokens",
        "prepare_corpus",
        "read_header",
        "write_token_file",
    ],
    "bdh_train.train": [
        "CheckpointConfig",
        "Checkpointer",
        "EvalResult",
        "GradientScale",
        "GradientScaleRamp",
        "GradientScaleSchedule",
        "InitTransferConfig",
        "LanguageTrainModel",
        "OptimizerConfig",
        "StepExecutor",
        "TrainingConfig",
        "WeightedGradientAccumulator",
        "all_reduce_accumulated",
        "evaluate",
        "init_weights_from",
        "learning_rate",
    ],
    "bdh_train.distributed": [
        "BDHStage",
        "DistContext",
        "ParallelConfig",
        "PipelinePlan",
        "PipelineRunner",
        "SCHEDULES",
        "build_pipeline_plan",
        "render_timeline",
    ],
    "bdh_train.config": [
        "DEFAULT_PRESET",
        "PRESETS",
        "RunConfig",
        "SECTIONS",
        "dump_toml",
        "load_config",
        "load_train_config",
        "parse_override",
        "save_config",
    ],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_pinned_and_resolve(package: str) -> None:
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package])
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name} is listed but not defined"


def _has_own_docstring(cls: type) -> bool:
    """Whether the class statement has a docstring (read from the source: a dataclass
    without one gets its signature as __doc__)."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    return isinstance(node, ast.ClassDef) and ast.get_docstring(node) is not None


def test_exported_classes_have_docstrings() -> None:
    missing = set()
    for package, names in PUBLIC.items():
        module = importlib.import_module(package)
        for name in names:
            value = getattr(module, name)
            if inspect.isclass(value) and not _has_own_docstring(value):
                missing.add(f"{package}.{name}")
    assert missing == set(), "document these exported classes"
