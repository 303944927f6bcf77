"""How an untrained model does on the candidate tasks of a method study, before choosing one.

A study that compares training methods needs a reward the model can move within a few dozen steps: the rewarded
behaviour must already be sampled now and then (GRPO learns only from groups whose rewards differ) and be far from
saturated. This samples ``--samples`` completions for each of ``--prompts`` prompts of each task, at the study's
temperature and completion length, and prints the mean reward, the share of exact (1.0) replies, the share of
groups without any spread, and a few replies. Tasks:

- ``word_choice``: :mod:`a3po_trl.tasks.word_choice` (reply with one word of a list), its graded reward;
- ``bare_sum``: "What is a + b? Reply with only the number." (a, b in 1..20, or a - b with a >= b): 1.0 for the bare
  correct number, 0.5 for the correct number as the last number of a longer reply, 0.0 otherwise.

    python -m benchmarks.task_probe                       # SmolLM2-135M-Instruct, 8 prompts x 8 samples, T=0.7
"""

from __future__ import annotations

import argparse
import random
import re
import statistics

_NUMBER = re.compile(r"-?\d+")


def _bare_sum_prompts(count: int, rng: random.Random) -> list[tuple[list[dict], str]]:
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {max(a, b)} - {min(a, b)}?", max(a, b) - min(a, b)
        rows.append(([{"role": "user", "content": f"{question} Reply with only the number."}], str(answer)))
    return rows


def _bare_sum_score(text: str, answer: str) -> float:
    if text.strip().rstrip(".").strip() == answer:
        return 1.0
    numbers = _NUMBER.findall(text)
    return 0.5 if numbers and numbers[-1] == answer else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from a3po_trl.tasks.offline_model import resolve_model_path
    from a3po_trl.tasks.word_choice import make_word_choice_splits, score_word_choice

    path = resolve_model_path(options.model)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _, held_out = make_word_choice_splits(num_train=1, num_held_out=options.prompts, seed=options.seed)
    tasks = {
        "word_choice": ([(row["prompt"], row["choices"]) for row in held_out], score_word_choice),
        "bare_sum": (_bare_sum_prompts(options.prompts, random.Random(options.seed)), _bare_sum_score),
    }
    torch.manual_seed(options.seed)
    for name, (rows, score) in tasks.items():
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p, _ in rows]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            output = model.generate(
                **batch,
                do_sample=True,
                temperature=options.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=options.max_new_tokens,
                num_return_sequences=options.samples,
                pad_token_id=tokenizer.pad_token_id,
            )
        replies = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        rewards = [score(reply, rows[i // options.samples][1]) for i, reply in enumerate(replies)]
        groups = [rewards[i : i + options.samples] for i in range(0, len(rewards), options.samples)]
        print(
            f"{name}: mean reward {statistics.fmean(rewards):.3f}, exact {sum(r == 1.0 for r in rewards)}"
            f"/{len(rewards)}, groups without spread {sum(len(set(g)) == 1 for g in groups)}/{len(groups)}"
        )
        for reply, reward in list(zip(replies, rewards))[:: options.samples][:4]:
            print(f"    {reward:.2f}  {reply.strip()[:70]!r}")


if __name__ == "__main__":
    main()
