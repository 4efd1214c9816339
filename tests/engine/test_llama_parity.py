"""Our Llama-family model over a paged KV cache vs HF transformers `generate`, greedy.

A minimal paged-KV driver lives here (the real model runner is tested elsewhere): it hands out
blocks from a shuffled free list (non-contiguous block tables, partial last blocks), builds the
`AttentionMetadata` of each varlen step, and samples greedily. Tolerances (float32 logits):
tiny random models atol 1e-4 / rtol 1e-4; SmolLM2 (30 layers, logits of magnitude ~20) atol 1e-3
(observed ~1e-4).
Greedy tokens must be identical.
"""

import random

import pytest
import torch

from deepinfer.engine.loader import default_gguf_path, load_model, load_tokenizer
from deepinfer.kernels.attention_metadata import AttentionMetadata

pytestmark = pytest.mark.usefixtures("torch_single_thread")
MAX_NEW_TOKENS = 32


class PagedDriver:
    """Stand-in for the model runner: block allocation, metadata, one forward per step."""

    def __init__(self, model, num_blocks: int, block_size: int, seed: int = 0,
                 device: str = "cpu") -> None:
        self.model, self.block_size, self.device = model, block_size, device
        spec = model.kv_cache_spec(model.dtype.itemsize)  # the model's per-layer KV layout
        self.kv_caches = [torch.zeros(spec.kv_cache_shape(num_blocks, block_size),
                                      dtype=model.dtype, device=device)
                          for _ in range(spec.num_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def _schedule(self, seq: int, num_tokens: int) -> tuple[list[int], list[int]]:
        """Allocate blocks for `num_tokens` more tokens: (positions, slots)."""
        start = self.num_cached.get(seq, 0)
        table = self.block_tables.setdefault(seq, [])
        while len(table) * self.block_size < start + num_tokens:
            table.append(self.free_blocks.pop())
        self.num_cached[seq] = start + num_tokens
        positions = list(range(start, start + num_tokens))
        slots = [table[p // self.block_size] * self.block_size + p % self.block_size
                 for p in positions]
        return positions, slots

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one varlen step; returns each sequence's logits [vocab] float32 at its last
        scheduled token."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, tokens in chunks.items():
            seq_positions, seq_slots = self._schedule(seq, len(tokens))
            input_ids += tokens
            positions += seq_positions
            slots += seq_slots
            query_lens.append(len(tokens))
            seq_lens.append(self.num_cached[seq])
        tables = [self.block_tables[seq] for seq in chunks]
        width = max(len(table) for table in tables)
        starts = torch.tensor([0] + query_lens).cumsum(0)
        metadata = AttentionMetadata(
            query_start_loc=starts.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        if self.device != "cpu":
            for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
                setattr(metadata, name, getattr(metadata, name).to(self.device))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids, device=self.device),
                                torch.tensor(positions, device=self.device),
                                self.kv_caches, metadata)
            logits = self.model.compute_logits(hidden[starts[1:] - 1])
        return dict(zip(chunks, logits))


def generate_greedy(driver, prompts, *, chunk_size=None, stagger=False):
    """Greedy decoding of all prompts together: sequence i joins at step i when `stagger`, and
    prompts are computed `chunk_size` tokens per step, so steps mix prefill chunks and decodes.

    Returns (tokens: list of MAX_NEW_TOKENS ids per prompt, logits: [MAX_NEW_TOKENS, vocab] per
    prompt).
    """
    pending = {seq: list(prompt) for seq, prompt in enumerate(prompts)}
    tokens = {seq: [] for seq in pending}
    logits = {seq: [] for seq in pending}
    step = 0
    while any(len(out) < MAX_NEW_TOKENS for out in tokens.values()):
        chunks = {}
        for seq in pending:
            if (stagger and seq > step) or len(tokens[seq]) == MAX_NEW_TOKENS:
                continue
            if pending[seq]:
                size = chunk_size or len(pending[seq])
                chunks[seq], pending[seq] = pending[seq][:size], pending[seq][size:]
            else:
                chunks[seq] = [tokens[seq][-1]]
        for seq, row in driver.step(chunks).items():
            if not pending[seq]:  # the prompt is complete: this row predicts the next token
                logits[seq].append(row)
                tokens[seq].append(int(row.argmax()))
        step += 1
    return ([tokens[seq] for seq in pending], [torch.stack(logits[seq]) for seq in pending])


def hf_greedy(hf_model, prompts):
    """HF generate, greedy, exactly MAX_NEW_TOKENS tokens for each prompt, all prompts in one
    left-padded batch: (tokens per prompt, logits [N, vocab] float32 per prompt)."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=mask, do_sample=False,
                                max_new_tokens=MAX_NEW_TOKENS, output_logits=True,
                                return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()  # [num_prompts, N, vocab]
    return out.sequences[:, width:].tolist(), list(logits)


def load_hf_reference(cls, path, **kwargs):
    model = cls.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None  # always MAX_NEW_TOKENS tokens
    model.generation_config.pad_token_id = 0
    return model


# ---------------------------------------------------------------- tiny random models


def _tiny_config(variant: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=None)
    if variant == "llama_gqa":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if variant == "llama_tied_llama3_rope":  # also head_dim * heads != hidden_size
        return LlamaConfig(**common, head_dim=32, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    assert variant == "qwen2_qkv_bias"
    return Qwen2Config(**common, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama_gqa", "llama_tied_llama3_rope", "qwen2_qkv_bias"])
def tiny_pair(request, tmp_path_factory):
    """(our model, HF model) with the same random weights, saved and loaded through disk."""
    from transformers import AutoModelForCausalLM

    config = _tiny_config(request.param)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):  # HF initialises biases to zero: make them matter
                param.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    ours = load_model(path, torch.float32, "cpu")
    return ours, load_hf_reference(AutoModelForCausalLM, path)


TINY_PROMPT_LENS = [1, 6, 13, 29]


def _tiny_prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in TINY_PROMPT_LENS]


def _assert_matches_hf(hf_model, prompts, tokens, logits, atol):
    hf_tokens, hf_logits = hf_greedy(hf_model, prompts)
    for seq in range(len(prompts)):
        assert tokens[seq] == hf_tokens[seq], f"prompt {seq}"
        torch.testing.assert_close(logits[seq], hf_logits[seq], atol=atol, rtol=1e-4)


def test_tiny_model_one_sequence_at_a_time_matches_hf(tiny_pair):
    ours, hf_model = tiny_pair
    prompts = _tiny_prompts()
    results = [generate_greedy(PagedDriver(ours, num_blocks=32, block_size=4), [prompt])
               for prompt in prompts]
    tokens = [tok[0] for tok, _ in results]
    logits = [log[0] for _, log in results]
    _assert_matches_hf(hf_model, prompts, tokens, logits, atol=1e-4)


def test_tiny_model_mixed_varlen_steps_match_hf(tiny_pair):
    ours, hf_model = tiny_pair
    prompts = _tiny_prompts()
    driver = PagedDriver(ours, num_blocks=96, block_size=4, seed=3)
    tokens, logits = generate_greedy(driver, prompts, chunk_size=5, stagger=True)
    _assert_matches_hf(hf_model, prompts, tokens, logits, atol=1e-4)


def test_model_reports_kv_cache_geometry(tiny_pair):
    ours, _ = tiny_pair
    assert ours.kv_cache_shape(10, 16) == (2, 10, 16, ours.num_kv_heads, ours.head_dim)
    assert ours.num_layers == 2 and ours.num_kv_heads == 2
    assert ours.head_dim == (getattr(ours.config, "head_dim", None) or 64 // 4)


# ---------------------------------------------------------------- the real SmolLM2

SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "hi",
]


@pytest.mark.slow
def test_smollm2_matches_hf_gguf_reference(smollm2_dir):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
               for text in SMOLLM2_PROMPTS]
    ours = load_model(smollm2_dir, torch.float32, "cpu")
    driver = PagedDriver(ours, num_blocks=64, block_size=16, seed=5)
    tokens, logits = generate_greedy(driver, prompts, chunk_size=24, stagger=True)
    del ours, driver
    gguf_path = default_gguf_path()
    hf_model = load_hf_reference(AutoModelForCausalLM, gguf_path.parent,
                                 gguf_file=gguf_path.name)
    _assert_matches_hf(hf_model, prompts, tokens, logits, atol=1e-3)


def test_tiny_model_with_folded_norms_matches_hf(tiny_pair, tmp_path):
    """`fold_norms` (what CUDA bf16 loads do): the RMSNorm weights moved into qkv / gate_up and
    the layers on `forward_folded` (the residual stream as (pending, residual)); on CPU every
    op takes its unfused form, so this checks the folding and the stream, in float32."""
    _, hf_model = tiny_pair
    hf_model.save_pretrained(tmp_path)
    folded = load_model(tmp_path, torch.float32, "cpu")
    folded.fold_norms()
    assert all(layer.norms_folded for layer in folded.layers)
    assert all(torch.equal(layer.input_layernorm.weight, torch.ones_like(
        layer.input_layernorm.weight)) for layer in folded.layers)
    prompts = _tiny_prompts()
    driver = PagedDriver(folded, num_blocks=96, block_size=4, seed=3)
    tokens, logits = generate_greedy(driver, prompts, chunk_size=5, stagger=True)
    _assert_matches_hf(hf_model, prompts, tokens, logits, atol=1e-4)
