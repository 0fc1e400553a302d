"""What the tests share, imported as ``from support.<module> import ...`` (pyproject.toml puts tests/ on the path
for pytest; see tests/conftest.py). No test module imports another test module or conftest.py
(tests/integration/test_tests_layout.py holds that).

- paths: the repository root and the tiny training recipe.
- tiny_targets: random tiny targets built in code: the 6-token Llama of the engine tests, one of every supported
  family, the training target; Hugging Face references; layer capture of one batch.
- chat_data: the testbed tokenizer, a tiny Llama over its vocabulary, chat records and files, regeneration's
  greedy reference.
- chat_templates: small Jinja templates after the real ones (Llama 3.1, Gemma, Qwen3) and what a sample supervises.
- shards: feature shards of the tiny training target, written with the real writer.
- manifests: untrusted shard manifests: a shard copy to edit, a manifest edit, the one error line.
- training: TrainConfig fields of a seconds-long CPU training, as command-line arguments, its logged losses; the
  online chat run (tiny chat target, chat data, shards extracted from it).
- packed_blocks: a tiny drafter, a stand-in target head, random samples and one drafter pass over packed blocks;
  the tile truth of a dense block mask.
- attention_cases: random inputs of the decode-attention and tree-attention kernels, and their masked references.
- processes: commands in subprocesses (checked runs, a test-only pause point, accelerate launch).
- triton_interpreter: scripts run under TRITON_INTERPRET=1 in a fresh process.
- exports: an exported drafter run where dflashkit cannot be imported; relative error of tensors.
- loss_inputs: random inputs of the block-loss engine.
- vllm_standin, vllm_capture_standin: CPU twins of vllm.LLM (serving; hidden-state capture), test doubles given to
  the code through its ``api`` parameters (targets/vllm/api.py ``VllmApi``); nothing of the product imports them
  (tests/integration/test_import_dag.py), the lab's CPU toys reach them as ``tests.support``.
"""
