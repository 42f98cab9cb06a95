"""Quality testbed: a small RoPE model trained on a task where cross-chunk attention matters.

The "coref" task (``tasks.py``) puts facts inside chunks so that some of them can only be read by
attending across a chunk boundary. A Llama-architecture model (``model.py``) is trained on it
(``train.py``) and saved as a Hugging Face directory; ``evaluate.py`` asks it the questions through
``services.engine.Engine`` in every serving mode and reports accuracy per question type, which is
what tells us what chunk-KV reuse costs in quality and how much the blend step buys back.

Nothing here imports torch at module import time except ``model.py``/``train.py``/``evaluate.py``;
``train.py`` needs only torch, numpy, safetensors, tokenizers and tqdm so that it runs on a bare
GPU machine with ``python3 -m loadgen.quality.train``.
"""
