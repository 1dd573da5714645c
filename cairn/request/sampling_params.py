"""SamplingParams: what a request asks of the sampler (temperature, top-k / top-p / min-p, penalties, bias, stops,
n, seed, log-probabilities), checked when it is made, and StructuredOutput, the grammar it may ask its output to
follow. A frozen value that the server's request models, the sequence, the logits processors (logits.py) and the
sampler (sampling.py) all read; torch-free.

What this is not: the sampler or the processors, nor the defaults a checkpoint's generation_config.json gives
(sampling.generation_defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.errors import SamplingError

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
MAX_N = 16  # most choices per request
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (see cairn.request.grammar): `kind` "json_object" (any JSON object),
    "json_schema", "lark" (Lark rules defining `answer`) or "text" (anything)."""

    kind: str
    schema: str | None = None  # json_schema: the JSON schema as a JSON string; lark: the rules
    think_end: str | None = None  # the output starts in a reasoning block this text ends; the grammar follows it
    think_budget: int | None = None  # most reasoning tokens before think_end is forced


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256  # most tokens to generate
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per earlier occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output (divides / multiplies)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100])
    min_tokens: int = 0  # no end-of-sequence, stop token or stop string before this many tokens
    n: int = 1  # independent choices generated from one prompt (the prompt is computed once)
    seed: int | None = None  # per-request seed: the same seed and prompt give the same tokens
    stop: tuple[str, ...] = ()  # stop strings; the output ends before the first occurrence
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in the text
    skip_special_tokens: bool = True  # leave the text of special tokens out of the output text (not its token ids)
    keep_special_tokens: tuple[str, ...] = ()  # special tokens whose text stays even so (a chat parser's markers)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens, beside the model's end-of-sequence tokens
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    logprobs: bool = False  # report the chosen token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives
    structured: StructuredOutput | None = None  # constrain the output to a grammar (response_format)
    cache_prompt: bool = True  # read and write the prefix cache for this request
    cache_salt: str | None = None  # the tenant's prefix-cache namespace (vLLM's): no cached state is shared with
    # a request of another salt, or of none, in any tier
    extra: dict = field(default_factory=dict, compare=False, hash=False)  # free-form per-request tags

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "keep_special_tokens", tuple(self.keep_special_tokens))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (len(self.logit_bias) <= 1024, "logit_bias may hold at most 1024 tokens"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]"),
            (self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed must be in [-2**63, 2**64)"),
            (0 <= self.top_logprobs <= 20, "top_logprobs must be in [0, 20]"),
            (len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
             "stop must be at most 16 non-empty strings"),
            (self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
             "cache_salt must be a non-empty string"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """The logits need the repetition / frequency / presence penalties or a bias."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or self.presence_penalty
                    or self.logit_bias)
