"""The vLLM backends (``use_vllm=True``): an in-process engine (:mod:`.colocate`) or a ``trl vllm-serve`` server
(:mod:`.server`, shared by several processes through :mod:`.shared_server`), what they share (how vLLM samples,
:mod:`.sampling`; the forms of the weights it loads, :mod:`.weight_loading`), how a backend is made from a trainer's
settings (:mod:`.make_backend`) and the worker extension vLLM loads (:mod:`.worker`). Nothing here imports vLLM until
a backend is built."""
