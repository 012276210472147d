"""The chat/data layer: one owner for reading chat sources and rendering conversations into verifier tokens.

- ``sources``: where rows come from (jsonl/json/parquet/Hub/folders), their ShareGPT/OpenAI normalisation and the
  held-out prompts reader.
- ``formats``: the two row formats' keys and role names.
- ``encoder``: ``ChatSettings`` (tokenizer + template override + mask method, set once in the pipeline's data
  section) and the ``ChatEncoder`` they build: full conversations with the assistant-only loss mask (prepare) and
  prompts with the generation prompt (regeneration, validation). Every stage renders through it, so a template
  override reaches them all alike.
- ``dataset``: the prepared dataset as later stages read it (lengths, vocabulary check, batches).
- ``errors``: DataError (the stage cannot run) and BadRow (one row is skipped, with its reason).
"""
