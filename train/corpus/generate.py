"""The two ways the target writes replies for the data jobs, nothing speculative: plain batched
``model.generate`` with left padding (``generate_replies``: a batch runs until its longest reply ends)
and transformers' continuous batching (``run_continuous``: a finished reply's row goes to the next
prompt at once, by the library's own scheduler).
"""

from __future__ import annotations

import torch


def generation_config(max_new_tokens: int, eos: list[int], pad_id: int, temperature: float):
    """The ``GenerationConfig`` of ``run_continuous``: greedy at temperature 0, else sampled."""
    from transformers import GenerationConfig

    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad_id, **sampling)


def batching_config(device: torch.device, in_flight: int, longest: int):
    """The continuous-batching settings for ``in_flight`` requests of at most ``longest`` tokens each.

    On an accelerator the library sizes its paged cache from free memory. On the CPU it would take 60 %
    of RAM, and touching that much memory slows decoding (measured: docs/studies/regeneration.md,
    "Regeneration: transformers' continuous batching against static batches"), so there the cache holds just
    the requests in flight, with prefill chunks of 1,024 tokens.
    """
    from transformers import ContinuousBatchingConfig

    if device.type != "cpu":
        return ContinuousBatchingConfig(max_requests_per_batch=in_flight)
    page = ContinuousBatchingConfig().page_size
    return ContinuousBatchingConfig(
        max_requests_per_batch=in_flight,
        num_blocks=in_flight * -(-longest // page),
        max_batch_tokens=1024,
    )


@torch.inference_mode()
def run_continuous(model, config, settings, dialogues, prompt_of, answered, write, more) -> None:
    """Every dialogue through transformers' continuous-batching manager, as many at a time as
    ``settings.max_requests_per_batch`` (a ``ContinuousBatchingConfig``, see ``batching_config``).

    A dialogue's next turn is asked for as soon as its last reply returns, and a new dialogue starts as
    soon as one ends; the library schedules the requests and refills finished rows. A dialogue is written
    the moment it ends, so a killed run loses only the dialogues in flight. No dialogue starts once
    ``more()`` is false.
    """
    stop = set(config.eos_token_id)
    waiting = iter(range(len(dialogues)))  # dialogues not started yet, in order
    asked: dict[str, int] = {}  # request id -> dialogue index
    in_flight = settings.max_requests_per_batch
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=settings, warmup=False
    ) as manager:

        def advance(i: int) -> None:
            """Ask for dialogue i's next reply, or write it when it has none left."""
            ids = prompt_of(dialogues[i])
            if ids is None:
                write(dialogues[i])
                return
            request = manager.add_request(
                ids, request_id=f"d{i}:{len(asked)}", max_new_tokens=config.max_new_tokens
            )
            asked[request] = i

        def fill() -> None:
            while len(asked) < in_flight and more() and (i := next(waiting, None)) is not None:
                advance(i)

        fill()
        while asked:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        "transformers' continuous-batching loop stopped before every reply came"
                    )
                continue
            if not result.is_finished():
                continue
            i = asked.pop(result.request_id)
            reply = list(result.generated_tokens)
            finished = bool(reply) and reply[-1] in stop
            answered(dialogues[i], reply[:-1] if finished else reply, finished)
            advance(i)
            fill()


@torch.inference_mode()
def generate_replies(
    model, prompts: list[list[int]], pad_id: int, eos: list[int], max_new_tokens: int, temperature: float
) -> list[tuple[list[int], bool]]:
    """Generate one reply per prompt in one left-padded batch: (reply token ids, ended with an eos token)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for b, prompt in enumerate(prompts):
        input_ids[b, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        attention_mask[b, width - len(prompt) :] = 1
    device = next(model.parameters()).device
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    sequences = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=eos,
        **sampling,
    )
    replies = []
    stop = set(eos)
    for row in sequences[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stop), None)
        replies.append((row if end is None else row[:end], end is not None))
    return replies
