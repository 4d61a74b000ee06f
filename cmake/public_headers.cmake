# troupe_header_closure(<out> <header>...): the headers, relative to the source root, that the
# given headers include with "..." or <...>, followed transitively (every #include line counts,
# conditional ones too: installing one header too many is harmless, one too few breaks consumers).
# The installed package ships the public headers (include/troupe/*.h) and, under
# include/troupe/detail/, this closure of them: the in-tree headers they need, and no others.
function(troupe_header_closure out)
  set(pending ${ARGN})
  set(seen "")
  while(pending)
    list(POP_FRONT pending header)
    if(header IN_LIST seen)
      continue()
    endif()
    list(APPEND seen ${header})
    file(STRINGS ${PROJECT_SOURCE_DIR}/${header} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[\"<]")
    foreach(line ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*[\"<]([^\">]+)[\">].*" "\\1" included "${line}")
      if(EXISTS ${PROJECT_SOURCE_DIR}/${included} AND NOT IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${included})
        list(APPEND pending ${included})
      endif()
    endforeach()
  endwhile()
  set(${out} ${seen} PARENT_SCOPE)
endfunction()
