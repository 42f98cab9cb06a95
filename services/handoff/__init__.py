"""The whole prefill-to-decode hand-off in one place.

  wire.py       the format: a request's chunk ids and private K/V (``Handoff``), to and from bytes
  export.py     on the prefill worker's engine: a finished pass's private K/V staged and exported
  imports.py    on the decode worker's engine: a hand-off rebuilt as a live sequence
  transport.py  between workers: the gRPC stream of a hand-off's parts (checksummed)
  cuda_ipc.py   between workers on one GPU: the K/V shared by CUDA IPC instead of copied
  nixl.py       between hosts or GPUs (handoff_transport="nixl"): the K/V read over NIXL (UCX) from the sender's
                registered memory, checked on landing; the stream carries only the offer
  prepare.py    on the decode worker, off its engine thread: a received hand-off parsed, its missing chunks
                fetched from the store and staged on the GPU before admission

The engine's ``prefill_handoff`` and ``import_handoff`` call export.py and imports.py; nothing here imports a worker.
"""
