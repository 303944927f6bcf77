"""The vLLM backends (``use_vllm=True``): an in-process engine (:mod:`.colocate`) or a ``trl vllm-serve`` server
(:mod:`.server`), what they share (:mod:`.common`), how they are built from a trainer's settings (:mod:`.setup`) and
the server-side worker extension (:mod:`.worker`). Nothing here imports vLLM until a backend is built."""
