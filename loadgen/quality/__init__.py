"""Quality testbed: small RoPE models trained on tasks where what the serving path drops costs answers.

The "coref" task (``tasks.py``) puts facts inside chunks so that some of them can only be read by
attending across a chunk boundary. A Llama-architecture model (``model.py``) is trained on it
(``train.py``) and saved as a Hugging Face directory; ``evaluate.py`` asks it the questions through
``services.engine.Engine`` in every serving mode and reports accuracy per question type, which is
what tells us what chunk-KV reuse costs in quality and how much the blend step buys back.

The "longgen" task (``tasks.py``) asks many questions over a long context, answered in order in one
generation; ``longgen_eval.py`` generates the answers through ``Engine.generate`` under each decode
policy (dense, quest, retro) and reports accuracy overall and by answer position, which is what tells
us what a sparse decode budget costs as errors accumulate over a long generation.

Nothing here imports torch at module import time except ``model.py``/``train.py``/``objectives.py``/
``reference.py``/``evaluate.py``; ``train.py`` needs only torch, numpy, safetensors, tokenizers and
tqdm so that it runs on a bare GPU machine with ``python3 -m loadgen.quality.train``.
"""
