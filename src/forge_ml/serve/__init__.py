"""``forge-ml serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

``app.create_app(engine, model_id, ...)`` is the ASGI app (Starlette; run it under uvicorn),
``protocol`` checks requests and builds OpenAI's bodies, ``cli`` is the subcommand. The
server needs the ``serve`` extra (``pip install 'forge-ml[serve]'``); importing this package
alone imports neither Starlette nor uvicorn.
"""
