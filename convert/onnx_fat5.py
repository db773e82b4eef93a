from convert import alias

alias(__spec__.name, __name__)
