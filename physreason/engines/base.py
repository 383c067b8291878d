"""The Engine interface: requests (messages + frames) in, sampled token ids, text and logprobs out."""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Self

import numpy as np
import torch

from physreason.config import SamplingConfig
from physreason.errors import PhysReasonError
from physreason.vision import VideoFrames
from physreason.vision.resize import PATCH_FACTOR

if TYPE_CHECKING:
    from physreason.models.family import ProcessorParams
    from physreason.models.inputs import VisualInputs


@dataclass
class GenerationRequest:
    """One prompt: chat messages whose {'type': 'image'|'video'} parts match `images`/`videos` in order."""

    messages: list[dict]
    images: list[np.ndarray] = field(default_factory=list)  # each uint8 [H, W, 3], already resized
    videos: list[VideoFrames] = field(default_factory=list)
    request_id: str | None = None
    # The request's identity for seeded sampling (request_seed(...) of, e.g., data set and sample id): with a sampling
    # seed and temperature > 0 its completions are drawn from generators of their own (sampling_seed), so they do not
    # depend on the other requests of the call, their order or the batch size. None (GRPO rollouts): every row draws
    # from the call's shared stream, so duplicate requests of one prompt still get different completions.
    seed: int | None = None
    # The media already patchified (encode_visuals) with these processor parameters: an engine of the same parameters
    # uses them instead of patchifying again (GRPO keeps them for the policy's forward, physreason.train.rollout).
    encoded: tuple[ProcessorParams, VisualInputs] | None = field(default=None, repr=False, compare=False)

    def frame_size(self) -> tuple[int, int] | None:
        """(height, width) of the frame the model sees: the first video's (without its timestamp bar), else the
        first image's; None without media. 2D coordinates in Cosmos-Reason1's pixel grid refer to it."""
        if self.videos:
            return self.videos[0].frame_size
        if self.images:
            return int(self.images[0].shape[0]), int(self.images[0].shape[1])
        return None


_SEED_BITS = 62  # leaves room for + completion index below 2**63 (torch and vLLM seeds)


def request_seed(*identity: str | int) -> int:
    """A stable seed for a request from its identity (e.g. data set name and sample id): the same in every process
    and run (Python's hash() is not)."""
    digest = hashlib.blake2b(json.dumps(list(identity)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**_SEED_BITS


def sampling_seed(sampling: SamplingConfig, request: GenerationRequest) -> int | None:
    """The seed a request's own sampling starts from, or None when it draws from the call's shared stream (greedy,
    no sampling seed, or no request seed). Completion k of the request draws from seed + k, as vLLM seeds the n
    children of a seeded request; both engines take this seed."""
    if sampling.temperature == 0.0 or sampling.seed is None or request.seed is None:
        return None
    return request_seed(sampling.seed, request.seed)


@dataclass
class Completion:
    """One sampled continuation."""

    text: str
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the unmodified model distribution; [] if not asked
    finish_reason: Literal["stop", "length"]


@dataclass
class GenerationResult:
    """All completions of one request, or the error that stopped it (a batch never fails as a whole)."""

    request_id: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    error: str | None = None


class Engine(abc.ABC):
    """Generates completions for chat requests with images and videos.

    An engine holds its model (and, for vLLM, an engine core and process groups) until `close()`; use it as a
    context manager (`with create_engine(...) as engine:`) to close it however the block ends.
    """

    processor_params = None  # physreason.models.inputs.ProcessorParams of a vision-language model, else None
    _closed = False

    def close(self) -> None:
        """Release what the engine holds (model, caches, vLLM's engine core and process groups, GPU memory).

        Safe to call more than once. Afterwards generate, update_weights and load_adapter raise. A process that
        builds another engine (a second checkpoint, a test) closes the first one before: a dropped but unclosed
        vLLM engine keeps its GPU memory, and the next one does not fit.
        """
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:  # noqa: B027 (a hook: an engine that holds nothing of its own keeps it empty)
        """Free what this engine holds; close() calls it once. The base engine holds nothing of its own."""

    def _check_open(self) -> None:
        """Raise when close() was called: the model and engine core it would need are gone."""
        if self._closed:
            raise PhysReasonError(
                f"this {type(self).__name__} was closed (close() or the end of its `with` block) and holds no model: "
                "build a new engine with create_engine to generate again"
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def vision_factor(self) -> int:
        """Side multiple the model's frames and images must have (patch x merge; 28 when text-only)."""
        return self.processor_params.factor if self.processor_params is not None else PATCH_FACTOR

    @abc.abstractmethod
    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingConfig, *, logprobs: bool = True
    ) -> list[GenerationResult]:
        """Return one result per request, in order; per-request failures are in `result.error`.

        `logprobs=False` skips the log-probability of each sampled token (inference and evaluation do not
        use them; RL rollouts do): the completions' `logprobs` are then empty lists.
        """

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (Hugging Face parameter names) into the running engine and drop stale caches."""

    @property
    def serves_adapters(self) -> bool:
        """True when `load_adapter` can swap LoRA adapters at run time (vLLM built with LoRA slots)."""
        return False

    def load_adapter(self, path: str) -> None:
        """Serve the PEFT LoRA adapter in folder `path` on top of the base weights from the next generate on.

        Replaces the adapter served before. Engines without runtime adapters raise; push merged weights
        with `update_weights` to them instead.
        """
        self._check_open()
        raise PhysReasonError(
            f"the {type(self).__name__} cannot load LoRA adapters at run time: push merged weights with update_weights"
        )
