"""The request field an engine's INVALID_ARGUMENT is about, carried to the gateway in the call's
trailing metadata, so that the gateway's 400 names it as OpenAI's error envelope does (`param`,
`code`). Absent: the gateway names `messages` (the prompt as a whole)."""

PARAM_KEY = "strata-param"
CODE_KEY = "strata-code"
