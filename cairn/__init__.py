"""cairn: a serving engine for hybrid language models whose prefix cache resumes a conversation
anywhere along it.

    from cairn import LLM, SamplingParams
    LLM(model="path/to/checkpoint").generate(["Hello"], SamplingParams(max_tokens=32))

Imports are lazy so that torch-free parts (the radix tree) can be used without torch.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from cairn.engine.llm import LLM

        return LLM
    if name == "Engine":
        from cairn.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from cairn.request.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from cairn.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
