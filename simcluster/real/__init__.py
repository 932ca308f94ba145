"""The real side: ``gloo_runner`` starts real gloo processes (FileStore in a private temp dir),
``gloo_child`` is all a child imports, ``differential`` compares the fake with real gloo.
"""
