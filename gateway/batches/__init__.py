"""The Batch API: OpenAI's /v1/files and /v1/batches, Anthropic's /v1/messages/batches.

A job's lines are kept in the state store (`database`, `files`, `jobs`) and answered by the
runner (`runner`, `lines`) through the same pipeline as every request, at batch priority; the
routes (`openai_routes`, `anthropic_routes`) translate each API's wire shape and nothing more.
"""
