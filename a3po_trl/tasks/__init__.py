"""The GSM8K / SmolLM2 demo application built on the trainer: math problems (:mod:`.problems`), their rewards
(:mod:`.rewards`), held-out evaluation (:mod:`.evaluation`), the offline SmolLM2 model (:mod:`.offline_model`), the
training plots (:mod:`.plotting`), the demo's settings (:mod:`.demo_settings`), the word-choice task of the staleness
study (:mod:`.word_choice`) and a tiny random model for smoke runs (:mod:`.tiny_model`). The trainer never imports this
package; ``import a3po_trl`` does not load it."""

from .evaluation import evaluate_accuracy, paired_accuracy_test
from .offline_model import DEFAULT_MODEL, ModelCacheError, ensure_smollm2, resolve_model_path
from .plotting import load_metrics, plot_training
from .problems import (
    DEFAULT_SYSTEM_PROMPT,
    difficulty_spec,
    generate_arithmetic_problems,
    load_gsm8k,
    make_math_splits,
    to_prompt_dataset,
)
from .rewards import correctness_reward, extract_answer, extract_reference_answer, format_reward
from .word_choice import make_word_choice_splits, score_word_choice, word_choice_reward

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_SYSTEM_PROMPT",
    "ModelCacheError",
    "correctness_reward",
    "difficulty_spec",
    "ensure_smollm2",
    "evaluate_accuracy",
    "extract_answer",
    "extract_reference_answer",
    "format_reward",
    "generate_arithmetic_problems",
    "load_gsm8k",
    "load_metrics",
    "make_math_splits",
    "make_word_choice_splits",
    "paired_accuracy_test",
    "plot_training",
    "resolve_model_path",
    "score_word_choice",
    "to_prompt_dataset",
    "word_choice_reward",
]
