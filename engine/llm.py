"""The vLLM-shaped offline API: ``LLM(model=...).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import itertools

from engine.config import EngineArgs
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.request import RequestOutput, SamplingParams

PromptType = str | dict


class LLM:
    """Runs all prompts through the continuous-batching loop and returns outputs in input order."""

    def __init__(self, model: str = "smollm2-135m-instruct", **engine_args):
        self.engine = LLMEngine(EngineArgs(model=model).with_overrides(**engine_args))
        self.engine.warm_up()  # offline generation steps the engine from this thread
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise EngineError("sampling_params must be one object or one per prompt")
        order = []
        for prompt, p in zip(prompts, params):
            request_id = f"offline-{next(self._ids)}"
            if isinstance(prompt, dict):
                self.engine.add_request(request_id, prompt=prompt.get("prompt"),
                                        prompt_token_ids=prompt.get("prompt_token_ids"), params=p)
            else:
                self.engine.add_request(request_id, prompt=prompt, params=p)
            order.append(request_id)
        return self._run(order)

    def _run(self, order: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(order):
                for output in self.engine.step(final_only=True):
                    if output.finished:
                        finished[output.request_id] = output
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [finished[request_id] for request_id in order]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; the model's chat template renders each."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.engine.tokenizer.encode_chat(conv)} for conv in conversations]
        return self.generate(prompts, sampling_params)

    def stats(self) -> dict:
        return self.engine.stats()
