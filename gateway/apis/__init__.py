"""Front doors: APIs other than OpenAI's chat completions, translated into the one pipeline.

Each module takes its API's request, validates it strictly, translates it into the canonical
chat-completions body (operation "chat"), and renders the pipeline's chat-shaped answer (JSON
or chunks) and its errors back in that API's shape. No stage learns about wire formats.
"""
