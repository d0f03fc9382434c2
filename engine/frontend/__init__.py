"""The one front end above every core client: request ids, input processing, streams,
call guards, closed and dead state (`engine.FrontEnd`)."""
