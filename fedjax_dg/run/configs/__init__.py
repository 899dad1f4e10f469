"""Configs that other configs build on, inside the package (big_vision style):
`fedjax-dg demo` and the files in `experiments/` import them by module name, so
they work from any directory and in a non-editable install."""
