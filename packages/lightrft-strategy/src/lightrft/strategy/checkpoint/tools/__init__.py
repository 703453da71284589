"""Offline checkpoint tools, used by ``lightrft ckpt`` and never during training: read a
checkpoint in one process without the world that saved it (:mod:`.offline`,
:mod:`.contents`), describe and verify it (:mod:`.describe`, :mod:`.verify`), export it
to a Hugging Face directory (:mod:`.export`) and convert it between backends
(:mod:`.convert`; DeepSpeed's files written by a job of CPU ranks,
:mod:`.deepspeed_writer` and :mod:`.deepspeed_files`). They depend on the in-training
package (:mod:`lightrft.strategy.checkpoint`), never the other way round."""
