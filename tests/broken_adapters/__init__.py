"""Deliberately broken copies of the Llama adapter: the conformance kit must fail them."""
