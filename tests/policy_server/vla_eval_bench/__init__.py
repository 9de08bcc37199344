"""A vla-eval benchmark over our MetaWorld suite, for driving the policy server with vla-eval's own runner."""
