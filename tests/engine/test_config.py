"""EngineConfig and SamplingParams: ranges, env mapping, DeepInfer aliases."""

import re

import pytest

from deepinfer.engine.config import (CacheConfig, ConfigError, EngineConfig, SchedulerConfig,
                                     env_overrides)
from deepinfer.engine.sampling_params import SamplingParams


def test_env_overrides_map_deepinfer_variables():
    sections = env_overrides({"DEEPINFER_HF_MODEL_DIR": "/models/x", "DEEPINFER_BLOCK_SIZE": "32",
                              "DEEPINFER_ENABLE_PREFIX_CACHING": "false", "UNRELATED": "1"})
    assert sections == {"model": {"model": "/models/x"},
                        "cache": {"block_size": 32, "enable_prefix_caching": False}}
    config = EngineConfig().replace(**sections)
    assert config.model.model == "/models/x" and config.cache.block_size == 32
    assert config.scheduler == SchedulerConfig()


def test_env_override_with_a_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="DEEPINFER_MAX_NUM_SEQS='many'"):
        env_overrides({"DEEPINFER_MAX_NUM_SEQS": "many"})
    # a bool is not "false unless recognised" (found by black-box testing), and an optional
    # field's type is named plainly
    with pytest.raises(ValueError, match="'maybe' is not a valid bool .1/0, true/false"):
        env_overrides({"DEEPINFER_ENABLE_PREFIX_CACHING": "maybe"})
    with pytest.raises(ValueError, match="DEEPINFER_SEED='xyz' is not a valid int; "):
        env_overrides({"DEEPINFER_SEED": "xyz"})
    assert env_overrides({"DEEPINFER_ENFORCE_EAGER": " ON "}) == {
        "model": {"enforce_eager": True}}


def test_config_range_checks():
    with pytest.raises(ValueError, match="block_size=12"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        SchedulerConfig(max_num_seqs=0)


def test_replace_checks_the_types_of_simple_fields():
    """`EngineConfig.replace` (LLM(...) keywords, --speculative-config) refuses values of the
    wrong type by field name: no bool for an int, no string for a bool; an int is a float and
    None is allowed where the field says so."""
    config = EngineConfig()
    for section, values, message in (
            ("cache", {"block_size": "16"}, "block_size='16' must be an integer"),
            ("model", {"enforce_eager": "no"}, "enforce_eager='no' must be true or false"),
            ("scheduler", {"max_num_seqs": True}, "max_num_seqs=True must be an integer"),
            ("model", {"max_model_len": 1.5}, "must be an integer or null")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.replace(**{section: values})
    assert config.replace(cache={"gpu_memory_utilization": 1}).cache.gpu_memory_utilization == 1
    assert config.replace(model={"max_model_len": None}).model.max_model_len is None


def test_seq_seed_is_an_alias_of_seed():
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7).seq_seed == 7
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(seed=1, seq_seed=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature=-0.5"),
    ({"top_p": 0.0}, "top_p=0.0"),
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"logprobs": 21}, "logprobs=21"),
    ({"stop": [""]}, "stop strings"),
    ({"so_args": {"schema_type": "xml"}}, "schema_type='xml'"),
])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_string_is_normalised_to_a_list_and_seed_is_random_without_one():
    params = SamplingParams(stop="###")
    assert params.stop == ["###"]
    assert params.resolved_seed() != params.resolved_seed()
    assert SamplingParams(seed=5).resolved_seed() == 5


def test_fields_by_name_from_any_section_as_vllm_keywords():
    """`LLM(max_num_seqs=...)` (found by black-box testing: a TypeError naming ModelConfig)."""
    config = EngineConfig().with_fields(max_num_seqs=8, block_size=32, dtype="float32")
    assert (config.scheduler.max_num_seqs, config.cache.block_size, config.model.dtype) == (
        8, 32, "float32")
    with pytest.raises(TypeError, match="unknown engine option 'foo'; options are the fields"):
        EngineConfig().with_fields(foo=1)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        EngineConfig().with_fields(max_num_seqs=0)


def test_kernel_config_is_part_of_the_engine_config_with_documented_defaults():
    """`EngineConfig.kernel` (kernels/settings.py): every field documented in the docstring,
    with its default; `batch_invariant` reserved, off; reachable by name as the other fields."""
    import dataclasses

    from deepinfer.engine.config import KernelConfig

    config = EngineConfig()
    assert config.kernel == KernelConfig() and config.kernel.batch_invariant is False
    for f in dataclasses.fields(KernelConfig):
        assert f"    {f.name}:" in KernelConfig.__doc__, f.name
    changed = config.with_fields(fused_linears=False, gluon_block_m=[16, 64])
    assert changed.kernel.fused_linears is False
    assert changed.kernel.gluon_block_m == frozenset({16, 64})    # a list becomes a frozenset
    hash(changed.kernel)   # frozen and hashable


@pytest.mark.parametrize("kwargs, message", [
    ({"skinny_max_rows": 65}, r"KernelConfig.skinny_max_rows: 65 must be in \[0, 64\]"),
    ({"gluon_block_m": {8}}, r"gluon_block_m: \[8\] must be row buckets among 16, 32 and 64"),
    ({"pdl_release_early": {"lm_head"}}, r"\['lm_head'\] are not kernels; use"),
])
def test_kernel_config_range_checks_name_the_field_and_the_fix(kwargs, message):
    from deepinfer.engine.config import KernelConfig

    with pytest.raises(ValueError, match=message):
        KernelConfig(**kwargs)


def test_each_field_s_variable_and_flag_are_declared_once_on_the_field():
    """ENV_VARS and the serve flags are derived from the dataclass fields (`_field`)."""
    from deepinfer.engine.config import ENV_VARS, ModelConfig, engine_flags

    assert ENV_VARS["DEEPINFER_HF_MODEL_DIR"] == ("model", "model")
    assert ENV_VARS["DEEPINFER_KV_STORE_TIMEOUT_S"] == ("kv_transfer", "timeout_s")
    assert ENV_VARS["DEEPINFER_ENGINE_PROCESS"] == ("frontend", "engine_process")
    assert ENV_VARS["DEEPINFER_API_SERVER_COUNT"] == ("frontend", "api_server_count")
    assert ENV_VARS["DEEPINFER_BATCH_INVARIANT"] == ("kernel", "batch_invariant")
    # 23 + 8 of MultiModalConfig + 17 of ParallelConfig + 2 of FrontendConfig + 4 of
    # SpeculativeConfig + 1 of KernelConfig
    assert len(ENV_VARS) == 55
    flags = engine_flags()
    assert flags["num_kv_blocks"][:2] == ("cache", "num_blocks")
    assert flags["kv_cache_memory_gb"][2](1.5) == 3 << 29           # GiB -> bytes
    assert flags["max_num_seqs"][2](8) == 8
    assert flags["batch_invariant"][:2] == ("kernel", "batch_invariant")
    # 20 + 7 of MultiModalConfig + 12 of ParallelConfig + 2 of FrontendConfig + 4 of
    # SpeculativeConfig + 1 of KernelConfig
    assert "cache_dir" not in flags and len(flags) == 46
    assert "tokenizer" not in {f for f in ModelConfig.__dataclass_fields__}


def test_blas_determinism_default_leaves_an_explicit_setting():
    from deepinfer.engine.config import apply_blas_determinism

    environ = {}
    apply_blas_determinism(environ)
    assert environ == {"MKL_DYNAMIC": "FALSE"}
    environ = {"MKL_DYNAMIC": "TRUE"}
    apply_blas_determinism(environ)
    assert environ == {"MKL_DYNAMIC": "TRUE"}


def test_speculative_config_from_the_environment_and_its_checks():
    from deepinfer.engine.config import SpeculativeConfig, config_from

    config = config_from(env_overrides({"DEEPINFER_SPECULATIVE_METHOD": "ngram",
                                        "DEEPINFER_USE_NEXTN_DECODE": "3",
                                        "DEEPINFER_ENABLE_MTP_VARLEN": "0"}))
    assert config.speculative == SpeculativeConfig("ngram", 3, False)
    assert not EngineConfig().speculative.enabled          # off by default
    with pytest.raises(ValueError, match="speculative_method='eagle'"):
        SpeculativeConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="needs speculative_model"):
        SpeculativeConfig(speculative_method="draft_model")
    assert EngineConfig().with_fields(speculative_method="mtp").speculative.speculative_method \
        == "mtp"
