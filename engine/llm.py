"""Offline API: `LLM(model).generate(prompts, sampling_params)`, DeepInfer's interface."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from deepinfer.engine.config import EngineConfig, config_from, env_overrides
from deepinfer.engine.engine_core import EngineCore
from deepinfer.engine.outputs import RequestOutput
from deepinfer.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Run generation in this process, all prompts batched by the continuous-batching scheduler.

    Args:
        model: HF directory, `.gguf` file, or None for the embedded default (SmolLM2-135M).
        config: a full EngineConfig; `model` (if given) overrides its model path.
        **options: engine config fields by name, from any section (as vLLM's keywords), e.g.
            `dtype="float32"`, `max_model_len=2048`, `max_num_seqs=8`, `block_size=32`.
    The `DEEPINFER_*` environment variables apply underneath explicit arguments.

    Raises:
        TypeError: an option no config section has.
        ValueError: an option out of range (the config's own checks).
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None,
                 **options):
        if config is None:
            config = config_from(env_overrides())
        if model is not None:
            options["model"] = model
        if options:
            config = config.with_fields(**options)
        self.engine_core = EngineCore(config)
        self.tokenizer = self.engine_core.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; returns finished outputs in prompt order.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts, or one per prompt (default: greedy-free
                `SamplingParams()`). With n > 1 each prompt's output holds n choices
                (`outputs[j]`), choice j seeded with seed + j when a seed is given.
        A request that a step failed on alone comes back finished with finish_reason "error"
        and the cause in `error`; the others are unaffected.

        Raises:
            TypeError: a prompt is neither a string nor a list of token ids.
            ValueError / PromptTooLongError: a prompt is empty or does not fit the context.
            EngineDeadError: steps kept failing whatever ran (a broken device or model).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} "
                             "prompts; give one, or one per prompt.")
        core = self.engine_core
        # prompt i's choice j runs as request "i" (n = 1) or "i-j"; all are made (and checked)
        # before any is queued, so a bad prompt leaves nothing running
        requests: list[list] = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            ids = self._tokenize(prompt)
            requests.append([core.make_request(ids, choice, str(i) if params.n == 1 else f"{i}-{j}")
                             for j, choice in enumerate(params.fan_out())])
        for choices in requests:
            for request in choices:
                core.add_request(request)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=sum(map(len, requests)), disable=not use_tqdm, desc="generate") as bar:
            while core.has_unfinished_requests():
                for output in core.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [_merged([finished[r.request_id] for r in choices], str(i))
                for i, choices in enumerate(requests)]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"a prompt is a string or a list of token ids (ints), not "
                            f"{_short(prompt)}")
        return list(prompt)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None
             ) -> RequestOutput:
        """One chat conversation through the model's chat template."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return self.generate([list(ids)], sampling_params)[0]


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _merged(outputs: list[RequestOutput], request_id: str) -> RequestOutput:
    """One prompt's finished output: its only request's, or with n > 1 the first choice's
    carrying all n as `choices` (`RequestOutput.outputs`)."""
    if len(outputs) == 1:
        return outputs[0]
    choices = [dataclasses.replace(out.outputs[0], index=j) for j, out in enumerate(outputs)]
    return dataclasses.replace(outputs[0], request_id=request_id, choices=choices)
