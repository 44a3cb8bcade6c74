"""Making the training corpus, the one place the data path reads from: conversations in any shape
(``conversations``), rendered into masked, packed token rows and counted (``tokens``); and data the
target writes itself: prompts picked from conversations (``prompts``), replies regenerated
(``regenerate``) or prompts synthesized (``synthesize``) through the generation engines (``generate``).
``draftsmith data`` is ``cli``."""
